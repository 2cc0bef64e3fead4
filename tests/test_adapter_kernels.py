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
    assert len(kinds) == 5 and all(c["bitwise"] for c in q["cases"]), q  # 4 forward variants, DoRA's backward
    assert max(c["magnitude_rel_l2"] for c in q["cases"] if c["kernel"] == "backward-dora") <= 1e-5


def test_replay_adapter_term_fused_gives_the_same_output_and_gradients():
    """_AdapterTerm (replay with gradients) with the kernels enabled vs the PyTorch path: output and the gradients of
    the input, A and B equal bit for bit (the kernels touch only the elementwise parts); the DoRA magnitude's gradient within FP32 summation order (1e-5)."""
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
                assert (AK._STATE["launches"] > before) == (fused and dora)  # DoRA's backward kernel, when enabled
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


def test_step_kernels_agree_with_the_pytorch_path_within_one_bf16_ulp():
    """The single-token step kernels (the whole adapter term for <= 16 rows) against FrozenAdapter's PyTorch path:
    every variant and awkward shape qualifies (within 1 BF16 ulp, as close to FP64), almost every element is equal
    bit for bit (only the FP32 sums' order differs), and a row's output does not depend on the rows beside it."""
    q = _interpreted("""
        import json, torch
        from engine import adapter_kernels as AK
        q = AK.qualify_step(torch.device("cpu"))
        torch.manual_seed(1)
        x = torch.randn(5, 1, 700).bfloat16()
        W = (torch.randn(90, 700) * 0.04).bfloat16()
        A, B = torch.randn(16, 700) * 0.04, torch.randn(90, 16) * 0.05
        ms = 1.0 + 0.01 * torch.randn(1, 90)
        r = torch.nn.functional.linear(x, W)
        batch = AK.step_fused(r, x, A, B, ms, None, 2.0, True, False)
        alone = [AK.step_fused(r[i:i + 1], x[i:i + 1], A, B, ms, None, 2.0, True, False) for i in range(5)]
        q["rows_independent"] = all(torch.equal(batch[i:i + 1], alone[i]) for i in range(5))
        print(json.dumps(q))
    """)
    assert q["passed"], q
    kinds = {(c["dora"], c["bias"], c["round_lora"]) for c in q["cases"]}
    assert len(kinds) == 4 and len(q["cases"]) == 16, q  # 4 variants x 4 shapes (rows 1..16, rank 5/8/16)
    assert max(c["max_ulps"] for c in q["cases"]) <= 1.0
    assert min(c["bitwise_share"] for c in q["cases"]) >= 0.99, q
    assert q["rows_independent"]


def test_frozen_adapter_takes_the_step_kernels_on_few_rows_only():
    """FrozenAdapter (the samplers' adapter forward) with the step kernels qualified: a PEFT DoRA layer on 4 rows of
    one token launches them and agrees with the PyTorch path within 1 BF16 ulp; on 40 rows (a prefill) it does not
    launch them and equals the PyTorch path bit for bit."""
    r = _interpreted("""
        import json, torch
        from peft import LoraConfig, get_peft_model
        from engine import adapter_kernels as AK
        from engine.cuda_graphs import FrozenAdapter
        torch.manual_seed(0)
        net = torch.nn.Sequential()
        net.add_module("lin", torch.nn.Linear(300, 130, bias=True))
        net = net.to(torch.bfloat16)
        model = get_peft_model(net, LoraConfig(r=8, lora_alpha=16, target_modules=["lin"], use_dora=True))
        lora = model.base_model.model.lin
        torch.nn.init.normal_(lora.lora_B["default"].weight, std=0.05)
        model.eval()
        out = {}
        with torch.no_grad():
            for rows in (4, 40):
                x = torch.randn(rows, 1, 300).bfloat16()
                AK.reset()
                with FrozenAdapter(model):
                    ref = model(x)
                AK._STATE["step_devices"].add("cpu")
                n0 = AK._STATE["launches"]
                with FrozenAdapter(model):
                    got = model(x)
                ulps = float(AK._ulps_bf16(ref, got).max())
                out[rows] = {"launched": AK._STATE["launches"] - n0, "max_ulps": ulps, "equal": torch.equal(ref, got)}
        AK.reset()
        print(json.dumps(out))
    """)
    assert r["4"]["launched"] == 2 and r["4"]["max_ulps"] <= 1.0, r  # step_h + step_out, one layer
    assert r["40"]["launched"] == 0 and r["40"]["equal"], r


def test_sibling_projections_share_one_step_h_with_the_same_bits():
    """q/k/v-style siblings (one input, one parent module) with the step kernels: FrozenAdapter stacks their A
    matrices and launches one step_h for the group, then one step_out each -- outputs equal bit for bit to each
    projection alone (one step_h each); a new input (or an in-place change of it) recomputes the partials; a new
    adapter version (sync) restacks A."""
    r = _interpreted("""
        import json, torch
        from peft import LoraConfig, get_peft_model
        from engine import adapter_kernels as AK
        from engine.cuda_graphs import FrozenAdapter
        torch.manual_seed(0)
        class Attn(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.q_proj = torch.nn.Linear(300, 130, bias=False)
                self.k_proj = torch.nn.Linear(300, 40, bias=False)
                self.v_proj = torch.nn.Linear(300, 40, bias=False)
                self.o_proj = torch.nn.Linear(130, 300, bias=False)
            def forward(self, x):
                return self.q_proj(x).sum(-1) + self.k_proj(x).sum(-1) * self.v_proj(x).sum(-1)
        net = torch.nn.Sequential()
        net.add_module("self_attn", Attn())
        net = net.to(torch.bfloat16)
        model = get_peft_model(net, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj"],
                                               use_dora=True))
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.05)
        model.eval()
        AK.reset()
        AK._STATE["step_devices"].add("cpu")
        x = torch.randn(4, 1, 300).bfloat16()
        att = model.base_model.model.self_attn
        with torch.no_grad():
            fa = FrozenAdapter(model)
            groups = sorted({g for g, _ in fa.siblings.values()})
            with fa:
                n0 = AK._STATE["launches"]
                got = [att.q_proj(x), att.k_proj(x), att.v_proj(x)]
                launched = AK._STATE["launches"] - n0
                x2 = x.clone()
                again = [att.q_proj(x2), att.k_proj(x2)]
                x2.mul_(2)
                changed = att.v_proj(x2)
            fa.siblings.clear()  # each projection alone: one step_h each
            with fa:
                n1 = AK._STATE["launches"]
                alone = [att.q_proj(x), att.k_proj(x), att.v_proj(x)]
                launched_alone = AK._STATE["launches"] - n1
                v2_alone = att.v_proj(x2)
        AK.reset()
        print(json.dumps({"groups": groups, "launched": launched, "launched_alone": launched_alone,
                          "equal": [torch.equal(a, b) for a, b in zip(got, alone)],
                          "again_equal": [torch.equal(a, b) for a, b in zip(again, alone)],
                          "changed_equal": torch.equal(changed, v2_alone)}))
    """)
    assert len(r["groups"]) == 1, r
    assert r["launched"] == 1 + 3 and r["launched_alone"] == 3 + 3, r  # one step_h for the group, a step_out each
    assert all(r["equal"]) and all(r["again_equal"]) and r["changed_equal"], r


def test_install_keeps_the_pytorch_expressions_on_a_cpu_and_rejects_unknown_modes():
    from engine import adapter_kernels as AK

    assert AK.install("auto", "cpu") == "torch" and AK.install("torch", "cpu") == "torch"
    assert AK.install_step("auto", "cpu") == "torch" and AK.install_step("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="auto, torch"):
        AK.install("fast", "cpu")
    with pytest.raises(ValueError, match="adapter_step_kernels"):
        AK.install_step("fast", "cpu")
    import torch

    assert not AK.enabled(torch.zeros(2, dtype=torch.bfloat16))  # nothing qualified on the CPU outside the interpreter
    assert not AK.step_enabled(torch.zeros(2, 3, dtype=torch.bfloat16))


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
    assert AK.install_step("auto", "cuda") == "fused", AK.qualify_step(torch.device("cuda"))
    assert AK.step_enabled(torch.zeros(4, 1, 8, dtype=torch.bfloat16, device="cuda"))
    assert not AK.step_enabled(torch.zeros(17, 8, dtype=torch.bfloat16, device="cuda"))  # a prefill: PyTorch path
    # sibling projections' stacked step_h gives each projection's partials bit for bit as alone (27B widths)
    x = torch.randn(4, 1, 5120, device="cuda").bfloat16()
    As = [torch.randn(16, 5120, device="cuda") * 0.01 for _ in range(3)]
    part = AK.step_h(x, torch.cat(As, 0))
    for i, A in enumerate(As):
        assert torch.equal(part[..., 16 * i:16 * (i + 1)], AK.step_h(x, A))
    AK.reset()
