"""The fused adapter epilogue (engine/adapter_kernels.py) against the PyTorch expressions it replaces, on the CPU
through Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the flag is read when kernels are defined).
The GPU qualifies the same kernels at start-up (engine.runtime -> adapter_kernels.install) with the same check."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted as _interpreted

pytest.importorskip("triton")


def test_every_kernel_equals_the_pytorch_expressions_bit_for_bit():
    q = _interpreted("""
        import json, torch
        from engine import adapter_kernels as AK
        print(json.dumps(AK.qualify(torch.device("cpu"))))
    """)
    assert q["passed"], q
    kinds = {(c["kernel"], c.get("dora"), c.get("bias"), c.get("round_lora")) for c in q["cases"]}
    assert len(kinds) == 6 and all(c["bitwise"] for c in q["cases"]), q  # 4 forward variants, 2 backward
    assert max(c["magnitude_rel_l2"] for c in q["cases"] if c["kernel"] == "backward-dora") <= 1e-5


def test_replay_adapter_term_fused_gives_the_same_output_and_gradients():
    """_AdapterTerm (replay with gradients) with the kernels enabled vs the PyTorch path: output and the gradients of
    the input, A and B equal bit for bit; the DoRA magnitude's gradient within FP32 summation order (1e-5)."""
    r = _interpreted("""
        import json, torch
        from engine import adapter_kernels as AK
        from engine.adapter_grad import _AdapterTerm
        torch.manual_seed(0)
        N, din, dout, rank = 45, 96, 200, 8
        x0 = torch.randn(3, N, din).bfloat16()
        W = (torch.randn(dout, din) * 0.05).bfloat16()
        A0, B0 = torch.randn(rank, din) * 0.05, torch.randn(dout, rank) * 0.05
        m0 = 1.0 + 0.01 * torch.randn(dout)
        n = (W.float() + 2.0 * B0 @ A0).norm(dim=1)
        g = torch.randn(3, N, dout).bfloat16()
        out = {}
        for dora in (True, False):
            runs = []
            for fused in (False, True):
                AK.reset()
                if fused:
                    AK._STATE["devices"].add("cpu")
                x = x0.clone().requires_grad_(True)
                A, B, m = A0.clone().requires_grad_(True), B0.clone().requires_grad_(True), m0.clone().requires_grad_(True)
                result = x @ W.t()
                n0 = AK._STATE["launches"]
                y = _AdapterTerm.apply(result, x, A, B, m if dora else None, n if dora else None, None, 2.0, False)
                assert (AK._STATE["launches"] > n0) == fused  # the forward kernel ran only when enabled
                before = AK._STATE["launches"]
                y.backward(g)
                assert (AK._STATE["launches"] > before) == fused  # the backward kernel ran only when enabled
                runs.append((y.detach(), x.grad, A.grad, B.grad, m.grad if dora else None))
            (y0, gx0, gA0, gB0, gm0), (y1, gx1, gA1, gB1, gm1) = runs
            out[str(dora)] = {"out": torch.equal(y0, y1), "x": torch.equal(gx0, gx1), "A": torch.equal(gA0, gA1),
                              "B": torch.equal(gB0, gB1),
                              "m_rel": float((gm0 - gm1).norm() / gm0.norm()) if dora else 0.0}
        print(json.dumps(out))
    """)
    for dora, c in r.items():
        assert c["out"] and c["x"] and c["A"] and c["B"], (dora, c)
        assert c["m_rel"] <= 1e-5, (dora, c)


def test_install_keeps_the_pytorch_expressions_on_a_cpu_and_rejects_unknown_modes():
    from engine import adapter_kernels as AK

    assert AK.install("auto", "cpu") == "torch" and AK.install("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="auto, torch"):
        AK.install("fast", "cpu")
    import torch

    assert not AK.enabled(torch.zeros(2, dtype=torch.bfloat16))  # nothing qualified on the CPU outside the interpreter


@pytest.mark.gpu
def test_installed_for_cuda_the_fused_path_is_used_by_tensors_on_that_device():
    """`device: cuda` names the current device, tensors say cuda:0: the choice must apply to them (it did not, so
    replay ran the PyTorch expressions although the kernels had qualified)."""
    import torch

    from engine import adapter_kernels as AK

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    AK.reset()
    assert AK.install("auto", "cuda") == "fused"
    assert AK.enabled(torch.zeros(2, 2, dtype=torch.bfloat16, device="cuda"))
    AK.reset()
