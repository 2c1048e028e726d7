"""A short transformers.Trainer run: a BPE tokenizer trained here, PackingCollator and
seqpack attention in a random LlamaForCausalLM; every step runs and the loss decreases."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

torch = pytest.importorskip("torch", reason="seqpack.hf needs PyTorch: pip install 'seqpack[hf]'")
pytest.importorskip("transformers", reason="seqpack.hf needs transformers: pip install 'seqpack[hf]'")
tokenizers = pytest.importorskip("tokenizers", reason="the test trains a tokenizer: pip install 'seqpack[hf]'")

from hf_cases import model

import seqpack as sp
import seqpack.hf as sph

from helpers import train_tokenizer


@pytest.mark.slow
def test_trainer_with_packing_collator_and_seqpack_attention(tmp_path):
    from transformers import Trainer, TrainingArguments

    texts = [f"record {i % 7}: the packed rows keep every context apart " * (1 + i % 4) for i in range(96)]
    tokenizer = train_tokenizer(texts, tmp_path)
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    content, offsets = tokenizer.encode(texts)
    features = [{"input_ids": [bos, *content[offsets[i]:offsets[i + 1]].tolist(), eos]} for i in range(len(texts))]
    collator = sph.PackingCollator(sp.PackConfig(capacity=256, rows_per_batch=8),
                                   tokenizer_identity=tokenizer.identity)
    net = model("llama", vocab_size=tokenizer.vocabulary_size)
    net.config.use_cache = True  # Trainer turns it off (TrainingArguments.use_cache defaults to False)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=12,
                             gradient_accumulation_steps=2, max_steps=8, learning_rate=3e-3, logging_steps=1,
                             report_to=[], use_cpu=True, save_strategy="no", seed=0, dataloader_num_workers=0)
    trainer = Trainer(model=net, args=args, train_dataset=features, data_collator=collator)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 8 and trainer.state.global_step == 8
    assert losses[-1] < 0.8 * losses[0]
    assert net.config._attn_implementation == "seqpack"
