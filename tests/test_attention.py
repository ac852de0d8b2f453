"""Which attention kernel the model runs: fused on the CPU in fp32 and bf16,
at the test size and at the seeds' 9,216 tokens, and the recorder that says
so notices a fall back to the math kernel."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from octfw.diagnostics.attention import record_attention, sdpa_backend
from octfw.plugins.models.vjepa3d.config import PRESETS

from test_vjepa3d import make_batch, make_model

SEED_TOKENS = 16 * 24 * 24  # [64, 384, 384] in [4, 16, 16] patches

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def forward_backward(model, batch, dtype):
    """One training forward and backward as the engine runs it (bf16: autocast over fp32 weights)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = model(batch)
    out.loss.backward()


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_attention_of_the_model_runs_the_fused_kernel_forward_and_backward(dtype):
    model = make_model()
    batch = make_batch(model)
    with record_attention() as record:
        forward_backward(model, batch, dtype)
    depth, predictor_depth = PRESETS["tiny"]["depth"], PRESETS["tiny"]["predictor_depth"]
    # Context encoder, target encoder (no grad) and predictor: one call per block.
    assert len(record.calls) == 2 * depth + predictor_depth
    assert record.kernels == {"flash"}
    assert {call.dtype for call in record.calls} == {str(dtype).replace("torch.", "")}
    assert not any(call.masked for call in record.calls)
    # The target encoder runs without autograd: only the trainable blocks have a backward.
    assert record.backward_kernels == ["flash"] * (depth + predictor_depth)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_model_trains_with_only_the_flash_kernel_allowed(dtype):
    """With every other kernel disabled, a fall back would raise 'No available kernel'."""
    model = make_model()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        forward_backward(model, make_batch(model), dtype)
    assert all(p.grad is not None for p in model.predictor.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("preset, dtype", [
    pytest.param("small", torch.float32, id="small-fp32"),
    pytest.param("small", torch.bfloat16, id="small-bf16"),
    pytest.param("base", torch.bfloat16, id="base-bf16"),
])
def test_the_encoder_attention_at_the_seeds_9216_tokens_is_fused_on_the_cpu(preset, dtype):
    sizes = PRESETS[preset]
    heads, head_dim = sizes["num_heads"], sizes["embed_dim"] // sizes["num_heads"]
    assert sdpa_backend("cpu", dtype, 1, heads, SEED_TOKENS, head_dim) == "flash"


def test_the_recorder_sees_a_fall_back_to_math():
    """The check can fail: inputs or settings that rule out every fused kernel are reported as math."""
    assert sdpa_backend("cpu", torch.float32, 1, 2, 64, 8, backward=True) == "flash"
    with sdpa_kernel([SDPBackend.MATH]):
        assert sdpa_backend("cpu", torch.float32, 1, 2, 64, 8, backward=True) == "math"
    q = torch.randn(1, 2, 8, 64).transpose(-1, -2)  # head_dim not contiguous: no fused kernel takes it
    mask = torch.ones(64, 64, dtype=torch.bool)
    with record_attention() as record:
        F.scaled_dot_product_attention(q, q, q)
        F.scaled_dot_product_attention(q.contiguous(), q.contiguous(), q.contiguous(), attn_mask=mask)
        F.scaled_dot_product_attention(q.contiguous(), q.contiguous(), q.contiguous(), dropout_p=0.5)
    assert [(call.kernel, call.masked) for call in record.calls] == [("math", False), ("flash", True),
                                                                    ("math", False)]


def _load_suite():
    group = __import__("pathlib").Path(__file__).resolve().parent.parent / "benchmarks" / "accelerators"
    paths = [str(group), str(group.parent)]  # its siblings (model_efficiency), and benchmarks/_common.py
    sys.path[:0] = paths
    try:
        spec = importlib.util.spec_from_file_location("accelerator_suite", group / "accelerator_suite.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        for path in paths:
            while path in sys.path:
                sys.path.remove(path)


def test_the_accelerator_suite_records_small_base_and_large_attention_at_9216_tokens_in_bf16():
    """On CUDA the suite reports the kernel for the seeds' size; its cases come
    from the presets, and its recorder is the one tested above (run here at a
    small size on the CPU)."""
    suite = _load_suite()
    cases = suite.attention_cases(suite.CUDA_PRESETS, suite.SEED_IMAGE, suite.SEED_PATCH)
    encoder = {(c["preset"], c["heads"], c["head_dim"], c["tokens"]) for c in cases if c["part"] == "encoder"}
    assert {("small", 6, 64, SEED_TOKENS), ("base", 12, 64, SEED_TOKENS), ("large", 16, 64, SEED_TOKENS)} <= encoder
    assert suite.CUDA_DTYPE == torch.bfloat16
    records = suite.attention_section("cpu", [dict(c, tokens=64) for c in cases], torch.bfloat16)
    assert [r["kernel"] for r in records] == ["flash"] * len(cases)
    assert {r["dtype"] for r in records} == {"bfloat16"}
