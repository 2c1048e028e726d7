"""Packed evaluation of a transformers causal LM: each example's negative log-likelihood
summed from packed rows, and a ``Trainer.evaluate()`` whose ``eval_loss`` weighs targets.

The rule both keep: a loss over many examples is token-weighted (the NLL summed over every
supervised target, divided by the number of them) and the sums are taken in float64 from
the logits (transformers' own loss rounds the logits to float32). Packing then changes
nothing: the result equals evaluating every example alone.

* :func:`evaluate` runs a packed dataset on disk, a plan, an epoch or an iterable of
  batches through the model, one batch at a time flattened by :func:`~seqpack.hf.flat`,
  and returns an :class:`Evaluation`: each example's supervised targets and NLL sum.
* :class:`TokenWeightedEvaluation`, a mixin before ``transformers.Trainer``, makes
  ``eval_loss`` that token-weighted mean; Trainer's own averages the batches' mean
  losses, each batch weighing the same however many targets it holds.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from .._arguments import check_bool
from .._read_only import ReadOnlyArrays
from ..data.binding import BatchBinding
from ..errors import InvalidInputError
from ..io.progress import Progress
from ..layout.batch import BatchLayout
from ..packing.batches import PackedBatches
from ..packing.epoch import Epoch
from ..torch.sequences import sequence_logprobs
from ..torch.tensors import IGNORE_INDEX, eligible_logits
from .attention import NAME, check_runs_attention_functions, seqpack_attention
from .collators import flat


@dataclass(frozen=True, eq=False)
class Evaluation(ReadOnlyArrays):
    """What :func:`evaluate` measured, one entry per example, by ascending ordinal.

    ``ordinals`` (int64): each example's ordinal in the data (its segment in the packed
    batches); ``example_ids``: where each came from (``file:line`` for a dataset on disk,
    the example's ``id`` otherwise); ``targets`` (int64): its supervised targets;
    ``nll_sums`` (float64): the sum of ``-log p(target)`` over them (0 for an example with
    none). The arrays are read-only.
    """

    ordinals: np.ndarray
    example_ids: tuple[str, ...]
    targets: np.ndarray
    nll_sums: np.ndarray

    def __post_init__(self):
        arrays = {name: np.array(getattr(self, name), dtype=dtype) for name, dtype in
                  (("ordinals", np.int64), ("targets", np.int64), ("nll_sums", np.float64))}
        ids = tuple(self.example_ids)
        shapes = {name: array.shape for name, array in arrays.items()}
        if any(shape != (len(ids),) for shape in shapes.values()):
            raise InvalidInputError(f"an Evaluation needs one entry per example in every field; got "
                                    f"{len(ids)} example_ids and shapes {shapes}")
        for name, array in arrays.items():
            array.flags.writeable = False
            object.__setattr__(self, name, array)
        object.__setattr__(self, "example_ids", ids)

    @property
    def total_targets(self) -> int:
        """Supervised targets over every example: the loss's denominator."""
        return int(self.targets.sum())

    @property
    def loss(self) -> float:
        """The token-weighted mean NLL, ``nll_sums.sum() / targets.sum()`` (nan with no
        target, which :func:`evaluate` never returns)."""
        total = self.total_targets
        return float(self.nll_sums.sum() / total) if total else math.nan


class EvaluationProgress(Progress):
    """A bar over the examples scored, with the targets scored and their rate (io.progress's
    rules: drawn only when asked for and stderr is a terminal, silent without tqdm)."""

    def __init__(self, examples: int | None, enabled: bool = True):
        super().__init__(enabled)
        self.examples = self.targets = 0
        self.phase("evaluating", examples, " examples")

    def scored(self, examples: int, targets: int) -> None:
        self.examples += examples
        self.targets += targets
        if self._bar is not None:
            seconds = max(time.perf_counter() - self._start, 1e-9)
            self._bar.set_postfix_str(f"{self.targets:,} targets, {self.targets / seconds:,.0f} targets/s",
                                      refresh=False)
        self.advance(examples)


@dataclass(frozen=True)
class _Data:
    """``data`` as :func:`evaluate` reads it: its batches, built one at a time, and what is
    known of them before building any (None: learnt from the batches)."""

    batches: Callable[[], Iterator]
    binding: BatchBinding | None
    examples: int | None


#: What ``data`` may not be, and what to pass instead.
_REFUSED_DATA = (
    ((str, bytes, os.PathLike), "a path: open the dataset first, seqpack.open_dataset(path)"),
    (BatchLayout, "a single batch: pass a list of batches, [batch]"),
    (dict, "a dict (a tensors() or rows() dict names no examples): pass the batches themselves, or the dataset, "
           "plan or epoch they come from"),
    ((torch.Tensor, np.ndarray), "an array"),
)


def _data_of(data) -> _Data:
    """Check ``data``'s kind (not yet its batches, built later) and say what is known of it."""
    if isinstance(data, PackedBatches):  # a plan, or a dataset on disk
        return _Data(lambda: data.batches(reuse_buffers=True), data.binding, data.occurrence_count)
    if isinstance(data, Epoch):
        return _Data(lambda: iter(data.batches), data.batches[0].binding if len(data) else None,
                     getattr(data, "occurrence_count", None))
    for kinds, what in _REFUSED_DATA:
        if isinstance(data, kinds):
            raise InvalidInputError(f"evaluate takes a packed dataset (seqpack.open_dataset), a plan or epoch "
                                    f"(seqpack.plan, seqpack.pack) or an iterable of batches; data is {what}")
    if not isinstance(data, Iterable):
        raise InvalidInputError(f"evaluate takes a packed dataset (seqpack.open_dataset), a plan or epoch "
                                f"(seqpack.plan, seqpack.pack) or an iterable of batches, not {type(data).__name__}")
    return _Data(lambda: iter(data), None, None)


#: Config fields that bound the positions a model with learned position embeddings takes.
POSITION_LIMITS = ("n_positions", "max_position_embeddings")


def _forward(model, network, inputs: dict, batch, number: int):
    """``model``'s outputs on batch ``number`` flattened (``inputs``). An ``IndexError``
    there is a lookup past a table: for a model with learned positions (GPT-2, OPT), an
    example longer than its ``n_positions`` or ``max_position_embeddings``, which is named."""
    try:
        return model(**inputs, use_cache=False)
    except IndexError as error:
        records = batch.occurrence_records
        longest = int(np.argmax(records["stop"] - records["start"]))
        positions = int(records["stop"][longest] - records["start"][longest]) + 1  # (flat: its tokens, the last too)
        config = getattr(network, "config", None)
        limits = {name: getattr(config, name) for name in POSITION_LIMITS if isinstance(getattr(config, name, None), int)}
        known = ", ".join(f"{name} {value}" for name, value in limits.items()) or "no position limit in its config"
        raise InvalidInputError(
            f"batch {number}: the model failed to look up an embedding ({error}); its longest example, "
            f"{batch.example_ids[longest]!r}, takes {positions} positions and the model's config has {known}: a model "
            f"with learned positions needs examples no longer than them (pack with a capacity at most that)"
        ) from None


def _causal_lm(model):
    """The outermost transformers model inside ``model`` (``model`` itself, or the model a
    wrapper holds), its attention checked: every transformers model in it must run seqpack
    attention."""
    from transformers import AttentionInterface, PreTrainedModel

    if not isinstance(model, torch.nn.Module):
        raise InvalidInputError(f"model must be a transformers causal LM (a PreTrainedModel), not "
                                f"{type(model).__name__}")
    found = [(name, module) for name, module in model.named_modules() if isinstance(module, PreTrainedModel)]
    if not found:
        raise InvalidInputError(f"model must be a transformers causal LM (a PreTrainedModel); this "
                                f"{type(model).__name__} holds none")
    functions = AttentionInterface()
    for name, module in found:
        check_runs_attention_functions(module)
        implementation = module.config._attn_implementation
        if functions.get(implementation) is not seqpack_attention:
            where = f"its {name} ({type(module).__name__})" if name else f"this {type(module).__name__}"
            raise InvalidInputError(
                f"evaluate runs packed rows, which need seqpack attention; {where} uses {implementation!r}: call "
                f"seqpack.hf.register() and model.set_attn_implementation({NAME!r}) first (or load it with "
                f"attn_implementation={NAME!r} after register())"
            )
    return found[0][1]


def _vocabulary_size(model) -> int | None:
    """Rows of the model's input and output embeddings (the fewer), None when it exposes neither."""
    sizes = []
    for layer in ("get_input_embeddings", "get_output_embeddings"):
        try:
            weight = getattr(getattr(model, layer)(), "weight", None)
        except (AttributeError, NotImplementedError):   # transformers raises NotImplementedError when
            continue                                    # it finds no embeddings (speech, vision backbones)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            sizes.append(int(weight.shape[0]))
    return min(sizes) if sizes else None


def _check_vocabulary(size: int | None, binding: BatchBinding, what: str) -> None:
    needed = binding.vocabulary_size
    if size is not None and size < needed:
        raise InvalidInputError(
            f"the model's vocabulary ({what}) has {size} entries, fewer than the {needed} token IDs of the tokenizer "
            f"the data was packed with (its binding's vocabulary_size): evaluate with a model of that tokenizer"
        )


def _batch(number: int, item, binding: BatchBinding | None) -> BatchLayout:
    """Item ``number`` of the data, checked to be a batch under ``binding`` (when known)."""
    if not isinstance(item, BatchLayout):
        hint = " (a tensors() or rows() dict names no examples)" if isinstance(item, dict) else ""
        raise InvalidInputError(f"item {number} of data ({type(item).__name__}) is not a padded or packed batch"
                                f"{hint}: evaluate reads BatchLayout batches")
    if binding is not None and item.binding is not binding and item.binding != binding:
        raise InvalidInputError(f"batch {number} was built under another binding than the batches before it: "
                                f"evaluate batches of one tokenizer and split")
    return item


def evaluate(model, data, *, progress: bool = False) -> Evaluation:
    """Each example's supervised targets and summed NLL under ``model``, from packed rows.

    ``data``: a packed dataset on disk (:func:`seqpack.open_dataset`), a plan
    (:func:`seqpack.plan`), an epoch (:func:`seqpack.pack` or :func:`seqpack.pad`) or an
    iterable of batches. Each batch goes to the model as :func:`~seqpack.hf.flat` gives it
    (its examples in one row with ``cu_seq_lens_q``, no padding: transformers'
    padding-free layout, so the model computes nothing for a row's empty cells), under
    ``torch.no_grad()`` with the model in eval mode (every module's mode is restored
    afterwards); its logits are cast to float64 and each example's ``log p`` summed over
    its supervised targets (:func:`seqpack.torch.sequence_logprobs`), so the result equals
    running every example alone, whatever the packing or the batch. The model's own loss
    (float32) is not used; one batch's logits are held in float64 besides the model's own.
    ``progress=True`` draws a bar of examples with their targets and
    rates on stderr (a terminal only; needs tqdm).

    Returns an :class:`Evaluation`, one entry per example by ascending ordinal;
    ``evaluation.loss`` is the token-weighted mean NLL.

    The model must already run seqpack attention (``seqpack.hf.register()``, then
    ``model.set_attn_implementation("seqpack")`` or ``attn_implementation="seqpack"``):
    evaluate does not switch it, since the switch is a change of the model's config
    (silently skipped by models that cannot switch) that a caller sharing the model would
    see. Refused with an :class:`~seqpack.InvalidInputError`, before any forward where it can
    be known: a model (or a model inside it) on another attention, or one that never calls
    an attention function (OpenAI GPT); a model whose
    vocabulary is smaller than the data's binding's ``vocabulary_size`` (both named);
    ``data`` of another kind (a path, a single batch, a ``tensors()`` or ``rows()`` dict,
    an iterable holding anything but batches, batches under different bindings); data
    with no supervised target at all (the mean has no denominator); and an example that
    occurs twice (an ordinal met again, as in several epochs of one plan: each example is
    scored once, so evaluate one epoch at a time).
    """
    progress = check_bool("progress", progress)
    source = _data_of(data)
    network = _causal_lm(model)
    vocabulary = _vocabulary_size(network)
    if source.binding is not None:
        _check_vocabulary(vocabulary, source.binding, "its embeddings")
    device = network.device
    modes = [(module, module.training) for module in model.modules()]
    bar = EvaluationProgress(source.examples, enabled=progress)
    ordinals, ids, targets, sums, seen = [], [], [], [], set()
    binding = source.binding
    try:
        model.eval()
        with torch.no_grad():
            for number, item in enumerate(source.batches()):
                batch = _batch(number, item, binding)
                if binding is None:
                    binding = batch.binding
                    _check_vocabulary(vocabulary, binding, "its embeddings")
                fields = flat(batch)                       # its occurrences' sequences, in order
                inputs = {key: value.to(device) if isinstance(value, torch.Tensor) else value
                          for key, value in fields.items() if key != "labels"}
                outputs = _forward(model, network, inputs, batch, number)
                logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]   # [1, N, V]
                del outputs
                _check_vocabulary(int(logits.shape[-1]), binding, "its logits")
                scored = sequence_logprobs(logits.to(torch.float64), fields)
                del logits
                found = batch.occurrence_records["ordinal"].astype(np.int64)
                for index, ordinal in enumerate(found.tolist()):
                    if ordinal in seen:
                        raise InvalidInputError(
                            f"example {ordinal} ({batch.example_ids[index]!r}) occurs again in batch {number}: "
                            f"evaluate scores each example once, so pass one epoch (evaluate several apart)"
                        )
                    seen.add(ordinal)
                counts = scored.counts.cpu().numpy().astype(np.int64)
                ordinals.append(found)
                ids.extend(batch.example_ids)
                targets.append(counts)
                sums.append(0.0 - scored.sums.detach().cpu().numpy().astype(np.float64))
                bar.scored(found.size, int(counts.sum()))
    finally:
        for module, training in modes:
            module.training = training
        bar.close()
    if not ordinals or not sum(int(counts.sum()) for counts in targets):
        batches = f"{len(ordinals)} batch{'es' if len(ordinals) != 1 else ''}"
        raise InvalidInputError(f"the data ({batches}) holds no supervised target: its loss has no denominator")
    order = np.argsort(np.concatenate(ordinals), kind="stable")
    return Evaluation(np.concatenate(ordinals)[order], tuple(ids[i] for i in order.tolist()),
                      np.concatenate(targets)[order], np.concatenate(sums)[order])


def _shifted_targets(inputs) -> torch.Tensor | None:
    """A batch's targets aligned with its logits, -100 where not eligible: ``shift_labels``
    when given, else ``labels`` shifted left by one (``ForCausalLMLoss``'s rule), else None.
    ``inputs`` is a dict or any mapping (transformers' padding collators give a ``BatchEncoding``)."""
    if not isinstance(inputs, Mapping):
        return None
    if inputs.get("shift_labels") is not None:
        return inputs["shift_labels"]
    labels = inputs.get("labels")
    if not isinstance(labels, torch.Tensor):
        return None
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


class _Totals:
    """The NLL summed over an evaluation's targets so far (float64), and their count."""

    def __init__(self):
        self.nll = 0.0
        self.targets = 0


class TokenWeightedEvaluation:
    """A mixin that makes ``Trainer.evaluate()``'s ``eval_loss`` (and ``predict()``'s
    ``test_loss``) token-weighted: the NLL summed in float64 from the logits over every
    eligible target of every evaluation batch, divided by their number. That equals
    evaluating every example alone, however the collator packs the batches; Trainer's own
    value is the mean of the batches' mean losses.

    ``class MyTrainer(seqpack.hf.TokenWeightedEvaluation, transformers.Trainer): pass`` (also
    before ``trl.SFTTrainer``, and beside :class:`~seqpack.hf.SFTTokenCount`; TRL 1.16's fused
    LM head builds no logits, so there each evaluation batch costs TRL one more forward to
    make them, and TRL warns that ``return_outputs`` is deprecated). It overrides
    ``evaluation_loop``, to collect the sums and replace ``{prefix}_loss`` in its metrics,
    and ``compute_loss`` while an evaluation loop runs, to add each batch's sum from the
    model's logits; training, every other metric, their names and prefixes are Trainer's.
    A batch's targets are its ``shift_labels`` (as :class:`~seqpack.hf.PackingCollator`
    gives them), else its ``labels`` shifted by one (``DataCollatorWithFlattening``'s),
    -100 where not eligible; a batch without either adds nothing, and with no eligible
    target at all ``{prefix}_loss`` stays Trainer's. With several processes the sums are
    added across them (a feature accelerate repeats to even out the last batches counts
    each time). Outputs without logits (Liger's fused loss) are an
    :class:`~seqpack.InvalidInputError`. With a plain ``Trainer``, keep the features'
    masks with ``TrainingArguments(remove_unused_columns=False)``: else Trainer drops
    ``completion_mask`` (no argument of the model's forward) before the collator sees it.
    """

    _token_totals: _Totals | None = None

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        outer, totals = self._token_totals, _Totals()
        self._token_totals = totals
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only=prediction_loss_only,
                                             ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        finally:
            self._token_totals = outer
        key = f"{metric_key_prefix}_loss"
        if key in output.metrics:  # the batches had labels (on every process alike)
            nll, count = totals.nll, totals.targets
            if self.accelerator.num_processes > 1:
                local = torch.tensor([[nll, count]], dtype=torch.float64, device=self.accelerator.device)
                nll, count = self.accelerator.gather(local).sum(0).tolist()
            if count:
                output.metrics[key] = nll / count
        return output

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        totals = self._token_totals
        if totals is None:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        targets = _shifted_targets(inputs)  # read first: a label smoother pops the labels
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if targets is not None:
            logits = outputs.get("logits") if isinstance(outputs, dict) else None
            if not isinstance(logits, torch.Tensor):
                raise InvalidInputError("TokenWeightedEvaluation sums the NLL from the model's logits, and this "
                                        "evaluation batch's outputs hold none (Liger's fused loss skips them: "
                                        "evaluate without use_liger_kernel)")
            cells, gold = eligible_logits(logits.detach(), targets.to(logits.device))
            nll = torch.nn.functional.cross_entropy(cells.to(torch.float64), gold, reduction="sum")
            totals.nll += float(nll)
            totals.targets += int(gold.numel())
        return (loss, outputs) if return_outputs else loss
