"""The CPU KV cache is allocated on fresh anonymous pages (zeroed by the kernel when first
written) instead of being written with zeros at start-up."""

import gc

import pytest
import torch

from aieng.attention.torch_paged import TorchPagedAttention
from aieng.worker.kv_cache import KVCacheSpec, host_zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float16])
def test_host_zeros_are_zero_writable_and_outlive_their_mapping(dtype):
    t = host_zeros((3, 16, 2, 8), dtype)
    assert (t.shape, t.dtype, t.device.type) == ((3, 16, 2, 8), dtype, "cpu")
    assert t.is_contiguous()
    assert not t.any()
    gc.collect()  # the mapping's Python object is gone: the tensor holds it
    t[2, 15, 1] = 5
    t[0, 0, 0, 0] = -3
    assert int((t != 0).sum()) == 9
    assert t[2, 15, 1].float().tolist() == [5.0] * 8
    views = t.view(-1)[-8:]
    assert views.float().tolist() == [5.0] * 8


def test_an_empty_shape_is_an_empty_tensor():
    t = host_zeros((0, 16, 2, 8), torch.bfloat16)
    assert t.shape == (0, 16, 2, 8) and t.numel() == 0


@pytest.mark.parametrize("quantized", [False, True])
def test_the_spec_allocates_host_caches_as_zeros(quantized):
    spec = KVCacheSpec(2, 2, 8, 16, torch.int8 if quantized else torch.bfloat16,
                       torch.float32 if quantized else None)  # fmt: skip
    caches = spec.allocate(5, torch.device("cpu"), TorchPagedAttention())
    assert len(caches) == 2
    for layer in caches:
        for part in layer:
            assert part.device.type == "cpu" and not part.any()
            assert part.shape[0] == 5
