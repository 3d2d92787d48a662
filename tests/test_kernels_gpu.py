"""The compiled Triton kernels on a CUDA GPU against the PyTorch references on the CPU. Marked
``gpu``: deselected on machines without CUDA (the CPU suite compares the same kernels under the
interpreter), run by ``.ci/gpu-check`` on a GPU."""

from __future__ import annotations

import pytest
import torch

from kvpool.kernels import gather, scatter, score, vllm_layout
from kvpool.kernels.layouts import sglang_layout

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads, dim, block", [(8, 128, 16), (1, 64, 32), (4, 80, 16)])
def test_vllm_gather_scatter_on_cuda_equal_the_reference(variant, dtype, heads, dim, block):
    g = torch.Generator().manual_seed(0)
    nb, layers, tokens = 64, 3, 7 * block + 5
    if variant == "gpu":
        cpu = [torch.randn(nb, block, heads, 2 * dim, generator=g).to(dtype).permute(0, 2, 1, 3) for _ in range(layers)]
    else:
        cpu = [torch.randn(nb, heads, block, 2 * dim, generator=g).to(dtype) for _ in range(layers)]
    cuda = [c.cuda() for c in cpu]
    slots = torch.randperm(nb * block, generator=g)[:tokens]
    layout = vllm_layout(variant)
    ref = gather(cpu, slots, layout, impl="torch")
    got = gather(cuda, slots.cuda(), layout, impl="triton")
    assert torch.equal(got.cpu(), ref)
    scatter(ref.flip(2).contiguous().cuda(), cuda, slots.cuda(), layout, impl="triton")
    scatter(ref.flip(2).contiguous(), cpu, slots, layout, impl="torch")
    assert all(torch.equal(a.cpu(), b) for a, b in zip(cuda, cpu))


@pytest.mark.parametrize("name", ["layer_first", "page_first"])
def test_sglang_gather_on_cuda_equals_the_reference(name):
    g = torch.Generator().manual_seed(1)
    size, layers, heads, dim = 512, 4, 8, 128
    shape = (2, layers, size, heads, dim) if name == "layer_first" else (2, size, layers, heads, dim)
    cpu = torch.randn(shape, generator=g).to(torch.bfloat16)
    slots = torch.randperm(size, generator=g)[:100]
    layout = sglang_layout(name)
    assert torch.equal(gather(cpu.cuda(), slots.cuda(), layout, impl="triton").cpu(),
                       gather(cpu, slots, layout, impl="torch"))


@pytest.mark.parametrize("method", ["h2o", "snapkv", "adakv", "quest"])
def test_scores_on_cuda_equal_the_reference(method):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 32, 64, 128, generator=g)
    k = torch.randn(1, 8, 4099, 128, generator=g)
    ref = score(method, q, k, impl="torch")
    got = score(method, q.cuda(), k.cuda(), impl="triton").cpu()
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(got))
    torch.testing.assert_close(got[finite], ref[finite], rtol=1e-4, atol=1e-5)
