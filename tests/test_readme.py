"""The README is true: its Python blocks run, its commands are the CLI's, its tables are the package's."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import seqpack as sp
from seqpack import cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def blocks(language):
    """The README's fenced blocks of ``language`` (an untagged ``python`` block is "python")."""
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def commands(block):
    """Each command of a bash block, as argument lists: continuation lines joined, comments
    dropped, split at ``&&`` and ``|`` outside quotes."""
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command = []
        for token in [*lexer, "&&"]:
            if token in ("&&", "|"):
                if command:
                    yield command
                command = []
            else:
                command.append(token)


def pyproject_extras():
    """The names of pyproject.toml's extras (tomllib is Python 3.11 and later only)."""
    section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
    return re.findall(r"^(\w+) = \[", section, flags=re.M)


def test_readme_examples_run():
    """Each block runs on its own, as a reader would paste it into a fresh interpreter."""
    namespaces = []
    for block in blocks("python"):
        namespaces.append({})
        exec(compile(block, str(README), "exec"), namespaces[-1])
    assert len(namespaces) >= 3
    batch = next(namespace["batch"] for namespace in namespaces if "abc" in namespace)
    assert isinstance(batch, sp.PackedBatch)
    assert batch.segments.tolist() == [[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, -1, -1]]
    padded = next(namespace["batch"] for namespace in namespaces if "short" in namespace)
    assert padded.inputs.tolist() == [[0, 99, -1, -1], [0, 100, 101, 102]]  # as the block's comments say
    assert padded.loss_mask.tolist() == [[True, True, False, False], [True, True, True, True]]


def test_from_raw_text_is_short_and_packs_every_prediction():
    """The first plain block: under 10 lines, every prediction of every text packed once."""
    block = blocks("python")[0]
    assert "from_texts" in block and len([line for line in block.splitlines() if line.strip()]) < 10
    namespace = {}
    exec(compile(block, str(README), "exec"), namespace)
    epoch, texts = namespace["epoch"], namespace["texts"]
    predictions = sum(len(text.encode()) + 1 for text in texts)  # content plus EOS, BOS is no target
    assert epoch.target_count == predictions
    assert len(namespace["table"]) > len(texts)  # the long text was cut, not truncated


def test_the_first_bash_block_is_the_two_setup_commands():
    """CI runs this block as written on a fresh machine; its seqpack commands parse as the CLI's."""
    first = [line for line in blocks("bash")[0].splitlines() if line.strip()]
    assert len(first) == 2
    install, *seqpack_commands = list(commands(first[0]))
    assert install == ["pip", "install", "."]
    assert [command[:2] for command in seqpack_commands] == [["seqpack", "pack"], ["seqpack", "verify"]]
    assert list(commands(first[1])) == [["pip", "install", ".[test]"], ["pytest"]]


def test_every_seqpack_command_in_the_readme_parses():
    """Every ``seqpack`` line of every bash block is accepted by the parser (no stale flag)."""
    parser = cli.build_parser()
    seen = 0
    for block in blocks("bash"):
        for command in commands(block):
            if command[0] == "seqpack":
                parser.parse_args(command[1:])  # exits 2 on an unknown flag or a bad value
                seen += 1
    assert seen >= 5


def test_the_every_extra_command_installs_every_extra_and_the_cpu_torch_first():
    extras = pyproject_extras()
    (torch, package, suite) = commands(blocks("bash")[1])
    assert torch[:3] == ["pip", "install", "torch==2.13.0+cpu"] and "https://download.pytorch.org/whl/cpu" in torch
    assert package[:2] == ["pip", "install"] and set(package[2][2:-1].split(",")) == set(extras)
    assert suite == ["pytest"]


def test_the_extras_table_and_the_command_table_are_the_packages():
    text = README.read_text()
    extras = pyproject_extras()
    assert set(re.findall(r"^\| `(\w+)` \| ", text, flags=re.M)) >= set(extras)
    parser = cli.build_parser()
    (subcommands,) = [action.choices for action in parser._actions if hasattr(action, "choices") and action.choices]
    listed = set(re.findall(r"^\| `seqpack (\w+)", text, flags=re.M))
    assert listed == set(subcommands)


def test_the_readme_is_a_guide_of_at_most_500_lines_with_its_sections_in_order():
    text = README.read_text()
    assert len(text.splitlines()) <= 500
    sections = re.findall(r"^## (.+)$", text, flags=re.M)
    order = ["From corpus to training", "PyTorch and Hugging Face", "Fine-tuning on prompts and conversations",
             "Preference pairs (DPO)", "Command line", "Ray", "On disk", "API", "Benchmarks"]
    assert [section for section in sections if section in order] == order
    assert (ROOT / "bench" / "RESULTS.md").is_file()


def test_the_own_corpus_block_runs(tmp_path):
    """The "your own corpus" bash block, run as written on JSONL files and a BPE trained here."""
    pytest.importorskip("tokenizers", reason="--tokenizer needs the hf extra: pip install 'seqpack[hf]'")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    (block,) = [block for block in blocks("bash") if "--out mydata/" in block]
    texts = [f"Record {i}: packing keeps the contexts of examples apart. " * (1 + i % 4) for i in range(60)]
    (tmp_path / "train.txt").write_text("\n".join(texts))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train([str(tmp_path / "train.txt")], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "data").mkdir()
    for part in range(2):
        (tmp_path / "data" / f"part{part}.jsonl").write_text(
            "".join(f'{{"text": "{text}"}}\n' for text in texts[part::2]))
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=environment,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "mydata: ok: the manifest matches its seal" in result.stdout
    assert (tmp_path / "mydata.svg").read_text().startswith("<svg")
    assert sp.open_dataset(tmp_path / "mydata").report().valid_targets > 0


def test_the_fine_tuning_blocks_run(tmp_path):
    """The fine-tuning section's Python block (as its comment says) and its command, run as
    written on prompt-completion records and a BPE trained here."""
    (block,) = blocks("python sft")
    namespace = {}
    exec(compile(block, str(README), "exec"), namespace)
    assert namespace["sft_batch"].target_count == 13  # " four" and " Paris", each with its EOS
    pytest.importorskip("tokenizers", reason="--tokenizer needs the hf extra: pip install 'seqpack[hf]'")
    from helpers import train_bpe

    records = [{"prompt": f"Question {i}: what is packed?", "completion": " Whole examples" + " apart" * (i % 5)}
               for i in range(40)]
    train_bpe(tmp_path, [r["prompt"] + r["completion"] for r in records], vocab_size=300)
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    (command,) = [block for block in blocks("bash") if "--out sft/" in block]
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=tmp_path, env=environment,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "supervised targets" in result.stdout
    dataset = sp.open_dataset(tmp_path / "sft")
    assert dataset.manifest["supervision"]["applied"] == ["prompt-completion"]
    assert 0 < int(dataset.batch_targets().sum()) < dataset.report().valid_targets
