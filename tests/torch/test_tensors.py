"""``seqpack.torch.tensors`` and the tensor exports: no warning, no copy of the stored
fields, an embedding-safe ``input_ids``, PyTorch dtypes; the optional import."""

import subprocess
import sys
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

import seqpack as sp

torch = pytest.importorskip("torch", reason="seqpack.torch needs PyTorch: pip install 'seqpack[torch]'")
import seqpack.torch as st  # noqa: E402

from packed_cases import packed_plan, padded_epoch  # noqa: E402


def batches():
    return [packed_plan([3, 2, 4, 1, 5, 6], 8).batch(0), padded_epoch([3, 1, 4])[0]]


@pytest.mark.parametrize("batch", batches(), ids=["packed", "padded"])
def test_fields_are_shared_without_a_warning(batch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = st.tensors(batch)
    for name in st.tensors.__globals__["SHARED_FIELDS"]:
        array = getattr(batch, name)
        assert result[name].data_ptr() == array.ctypes.data, name  # the batch's memory, not a copy
        assert result[name].numpy().dtype == array.dtype and result[name].tolist() == array.tolist(), name
    assert (batch.inputs == sp.PAD_CELL).any()  # the batch really has padding to replace


def test_threads_sharing_read_only_fields_leave_the_warning_filters_alone(monkeypatch):
    # Every call silenced PyTorch's warning inside warnings.catch_warnings, which is not
    # thread-safe: threads leaving it out of order left its filter installed (review).
    # PyTorch warns once a process, so only the first conversion needs silencing.
    import threading

    batch = batches()[0]
    assert not batch.inputs.flags.writeable
    st.tensors(batch)
    filters = list(warnings.filters)

    def unsafe():
        raise AssertionError("warnings.catch_warnings entered after PyTorch's one warning")

    module = sys.modules["seqpack.torch.tensors"]
    monkeypatch.setattr(module, "warnings", SimpleNamespace(catch_warnings=unsafe))
    failures = []

    def convert():
        try:
            for _ in range(100):
                st.tensors(batch)
        except AssertionError as error:
            failures.append(error)

    threads = [threading.Thread(target=convert) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == [] and warnings.filters == filters


@pytest.mark.parametrize("batch", batches(), ids=["packed", "padded"])
def test_input_ids_and_shift_labels(batch):
    result = st.tensors(batch)
    input_ids, labels = result["input_ids"], result["shift_labels"]
    assert input_ids.dtype == labels.dtype == torch.int64
    valid = torch.from_numpy(batch.token_valid.copy())
    assert torch.equal(input_ids[valid], torch.from_numpy(batch.inputs[batch.token_valid]).long())
    assert (input_ids[~valid] == 0).all() and input_ids.min() >= 0
    torch.nn.Embedding(266, 4)(input_ids)  # PAD_CELL would raise IndexError here
    supervised = torch.from_numpy(batch.loss_mask.copy())
    assert torch.equal(labels[supervised], torch.from_numpy(batch.targets[batch.loss_mask]).long())
    assert (labels[~supervised] == st.IGNORE_INDEX).all()


def test_device_copies_and_a_batch_is_required():
    batch = batches()[0]
    moved = st.tensors(batch, device="cpu")
    assert torch.equal(moved["inputs"], st.tensors(batch)["inputs"])
    with pytest.raises(sp.InvalidInputError, match="expected a padded or packed batch, not list"):
        st.tensors([batch])


@pytest.mark.parametrize("batch", batches(), ids=["packed", "padded"])
def test_tensor_exports_equal_the_numpy_ones_in_pytorch_dtypes(batch):
    dtypes = {"position_ids": torch.int64, "document_ids": torch.int32, "seq_lens": torch.int32,
              "cu_seqlens": torch.int32}
    for name, dtype in dtypes.items():
        tensor = getattr(st, name)(batch)
        assert tensor.dtype == dtype and tensor.tolist() == getattr(sp, name)(batch).tolist(), name
    assert st.max_seqlen(batch) == sp.max_seqlen(batch) and type(st.max_seqlen(batch)) is int


@pytest.mark.slow
def test_document_block_mask_is_the_permission_and_runs_flex_attention_forward():
    from torch.nn.attention.flex_attention import create_mask, flex_attention

    batch = packed_plan([3, 2, 4, 1, 5, 6, 7, 2], 8).batch(0)
    block_mask = st.document_block_mask(batch, block_size=8)
    rows, width = batch.shape
    dense = create_mask(block_mask.mask_mod, rows, 1, width, width, device="cpu")[:, 0].numpy()
    valid = batch.token_valid[:, :, None]
    np.testing.assert_array_equal(dense & valid, batch.dense_mask())
    rng = np.random.default_rng(0)
    q, k, v = (torch.from_numpy(rng.standard_normal((rows, 2, width, 4))) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile()": forward only, unfused
        expected = flex_attention(q, k, v, block_mask=block_mask)
    got = st.range_attention(q, k, v, segment_starts=batch.segment_starts, valid_lengths=batch.valid_lengths)
    keep = torch.from_numpy(batch.token_valid.copy())[:, None, :, None]
    torch.testing.assert_close(got * keep, expected * keep, rtol=1e-12, atol=1e-12)


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_importing_seqpack_never_imports_torch():
    result = run("import sys, seqpack; assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_seqpack_torch_without_torch_names_the_extra():
    result = run("import sys; sys.modules['torch'] = None\nimport seqpack.torch")
    assert result.returncode == 1
    assert "ImportError: seqpack.torch needs PyTorch, which is not installed: pip install 'seqpack[torch]'" \
        in result.stderr


def test_the_package_name_does_not_shadow_torch():
    assert st.torch is torch and "seqpack" not in torch.__file__
