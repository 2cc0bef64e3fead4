"""The NF4 small-batch kernel (engine/nf4_kernels.py). CPU: through Triton's interpreter (TRITON_INTERPRET=1, in a
subprocess) on weights packed in bitsandbytes' layout by the project's reference packer (bitsandbytes' quantizer
needs CUDA). GPU (`gpu` marker): against bitsandbytes itself -- its quantizer, dequantize_4bit and Linear4bit."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted as _interpreted


def test_the_kernel_dequantizes_bit_for_bit_and_is_as_accurate_as_dequantize_then_matmul():
    """Nested (double-quantized) and plain absmax, 1-16 rows, widths that end inside an absmax block and inside a
    step (1000), output counts below one program's block. Stated tolerance: relative L2 vs FP64 within 1.25x of the
    dequantize-then-matmul path's, largest error within 2x; the in-register weights equal the reference
    dequantization bit for bit; a row alone equals itself among others. Both layouts: the input split over several
    programs (FP32 partials, then the reduction kernel) with the levels gathered from the table and the products summed
    in registers (4 rows per program), one program per block of outputs (rounded in place) with the levels selected
    in registers and the products on tensor cores, both levels of a byte gathered at once, and each row's 16
    dequantized values per block gathered in registers; the "fma" form (four rows per program, one FP32 accumulator
    per row and weight position, summed along the input at the end) and the "wdot" form (the weights as the MMA's
    first operand; its "prmt" lookup runs as "shuffle" here: the interpreter runs no inline PTX, the lookup's PTX is
    checked by the emulated test below) -- a width that is not a multiple of the absmax block (1000) takes the general
    form there."""
    out = _interpreted("""
        import json, torch
        from engine import nf4_kernels as NK
        cases = ((4, 64, 512, True), (3, 48, 640, False), (7, 40, 1000, True), (16, 32, 256, True),
                 (1, 20, 130, True))
        res = []
        for cfg in ({"programs": 512, "lut": "gather", "block_k": 128, "mma": False},
                    {"programs": 1, "lut": "select", "block_n": 32, "mma": True},
                    {"programs": 512, "lut": "pairs", "block_k": 64, "mma": True},
                    {"programs": 512, "lut": "shuffle", "block_k": 128, "mma": True},
                    {"programs": 512, "lut": "shuffle", "block_k": 128, "block_n": 16, "form": "fma"},
                    {"programs": 1, "lut": "prmt", "block_k": 64, "block_n": 32, "form": "wdot"}):
            NK.CONFIG.update(cfg)
            n0 = NK._STATE["launches"]
            res.append({"qualification": NK.qualify(torch.device("cpu"), cases=cases),
                        "launches": NK._STATE["launches"] - n0})
        print(json.dumps(res))
    """)
    for r in out:
        assert r["launches"] >= 3 * 5, r  # the kernel really ran: the product, a one-hot probe, a row alone
    for r in out:
        assert r["qualification"]["passed"], r
        assert len(r["qualification"]["cases"]) == 5
    assert len(out) == 6
    for c in [c for r in out for c in r["qualification"]["cases"]]:
        assert c["dequant_bitwise"] and c["row_alone_bitwise"], c
        assert c["kernel_rel_l2"] <= 1.25 * c["torch_rel_l2"] + 1e-6, c
        assert c["kernel_max_abs"] <= 2.0 * c["torch_max_abs"] + 1e-6, c
        assert c["torch_rel_l2"] < 5e-3  # BF16-rounding accurate, not merely alike


def test_the_reference_packer_lays_weights_out_as_bitsandbytes_does():
    """High nibble = even element, low nibble = odd element of the flattened weight; blocks run over the flattened
    weight (a block may straddle rows); nested absmax = code2[q] * absmax2 + offset. Checked on a weight whose
    codes are known."""
    import torch

    from engine import nf4_kernels as NK

    lut = torch.tensor(NK.NF4_TABLE, dtype=torch.float32)
    codes = torch.arange(16).repeat(8)  # 128 elements: every code 8 times
    w = (lut[codes] * 0.5).view(4, 32)  # absmax 0.5 in both blocks of 64
    nw = NK.pack_nf4_reference(w, lut, blocksize=64, nested=False)
    assert nw.packed[0].item() == (0 << 4) | 1 and nw.packed[7].item() == (14 << 4) | 15
    assert torch.equal(nw.absmax, torch.tensor([0.5, 0.5]))
    assert torch.equal(NK.dequantize_reference(nw, torch.float32), w)
    nn = NK.pack_nf4_reference(w, lut, blocksize=64, nested=True)
    assert nn.absmax.dtype == torch.uint8 and nn.nested
    torch.testing.assert_close(NK.dequantize_reference(nn, torch.float32), w, rtol=2e-2, atol=1e-2)


def test_without_a_qualified_gpu_bitsandbytes_forward_stays():
    import torch

    from engine import nf4_kernels as NK

    NK.reset()
    assert NK.install("torch", "cpu") == "torch" and NK.install("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="auto, torch"):
        NK.install("fast", "cpu")

    class _Mod:
        weight = torch.zeros(1)

    assert not NK.enabled(torch.zeros(2, 8, dtype=torch.bfloat16), _Mod)


@pytest.mark.gpu
def test_on_cuda_the_kernel_qualifies_and_serves_linear4bit_steps_only():
    """Qualified against bitsandbytes at the 27B shapes; once installed, a Linear4bit's forward on 4 rows runs the
    kernel (within the qualification's accuracy of bitsandbytes' own), 17 rows or an input needing a gradient keep
    bitsandbytes' path; an NF4 tiny model's graphed latent loop equals its eager static loop bit for bit."""
    import torch

    from configs.schema import load_config
    from engine import cuda_graphs as CG
    from engine import model as M
    from engine import nf4
    from engine import nf4_kernels as NK

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import bitsandbytes as bnb

    NK.reset()
    try:
        q = NK.qualify(torch.device("cuda"))
        assert q["passed"], q
        lin = torch.nn.Linear(5120, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
        ref = bnb.nn.Linear4bit(5120, 1024, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                                compress_statistics=True, device="meta")
        ref.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, blocksize=64, compress_statistics=True,
                                       quant_type="nf4", quant_storage=torch.uint8, module=ref).to("cuda")
        x = torch.randn(4, 5120, device="cuda", dtype=torch.bfloat16)
        x17 = torch.randn(17, 5120, device="cuda", dtype=torch.bfloat16)
        y_bnb, y17_bnb = ref(x), ref(x17)
        assert NK.install("auto", "cuda") == "fused"
        n0 = NK._STATE["launches"]
        y = ref(x)
        assert NK._STATE["launches"] == n0 + 1
        wd = bnb.functional.dequantize_4bit(ref.weight.data, ref.weight.quant_state)
        exact = x.double() @ wd.double().T
        err = lambda a: float((a.double() - exact).norm() / exact.norm())  # noqa: E731
        assert err(y) <= 1.25 * err(y_bnb) + 1e-6
        assert torch.equal(ref(x17), y17_bnb) and NK._STATE["launches"] == n0 + 1  # 17 rows: bitsandbytes
        xg = x.clone().requires_grad_(True)
        ref(xg).float().sum().backward()  # needs a gradient: bitsandbytes' path, which has a backward
        assert NK._STATE["launches"] == n0 + 1 and xg.grad is not None

        cfg = load_config("tiny")
        toks = M.Tokens(pad=0, eos=1, think=2, answer_open=3)
        model = M.build_random_model(cfg.model.arch, 64, 0, 1, seed=0, dtype="bfloat16").cuda()
        nf4.quantize_nf4_(model)
        model = M.attach_adapter(model, cfg.adapter.model_copy(update={"type": "dora"})).eval()
        scale = M.embed_scale(model)
        g = torch.Generator().manual_seed(0)
        prefixes = [torch.randint(4, 64, (int(n),), generator=g).tolist() for n in (37, 90, 12, 50)]
        out = {}
        for graphed in (False, True):
            n1 = NK._STATE["launches"]
            loop = CG.GraphedLatentLoop(model, graphed=graphed)
            z, lq = loop.run(prefixes, 8, 0.05 * scale, scale, toks, torch.Generator(device="cuda").manual_seed(3))
            out[graphed] = (z, lq, NK._STATE["launches"] - n1)
        assert torch.equal(out[False][0], out[True][0]) and torch.equal(out[False][1], out[True][1])
        assert out[False][2] > 0
    finally:
        NK.reset()


def _run_ptx(asm: str, operands: dict) -> dict:
    """Execute the few PTX instructions the "prmt" lookup uses (mul.rn.f32, cvt.rn.bf16x2.f32, prmt.b32 in its
    default mode, and/or/shr.b32) with their documented semantics, on Python integers / NumPy FP32."""
    import struct

    import numpy as np
    import torch

    def bf16_bits(v) -> int:  # round to nearest even, as cvt.rn does
        return torch.tensor([float(v)], dtype=torch.float32).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF

    def prmt(a, b, c):
        src, out = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32), 0
        for k in range(4):
            s = (c >> (4 * k)) & 0xF
            byte = (src >> (8 * (s & 7))) & 0xFF
            if s & 8:  # sign-replicate mode
                byte = 0xFF if byte & 0x80 else 0
            out |= byte << (8 * k)
        return out

    regs = dict(operands)

    def val(t):
        if t in regs:
            return regs[t]
        if t.startswith("0f"):
            return np.frombuffer(struct.pack("<I", int(t[2:], 16)), np.float32)[0]
        return int(t, 0)

    for line in asm.split("\n"):
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        d, *src = [x.strip() for x in rest.split(",")]
        src = [val(x) for x in src]
        if op == "mul.rn.f32":
            regs[d] = np.float32(np.float32(src[0]) * np.float32(src[1]))
        elif op == "cvt.rn.bf16x2.f32":  # a -> upper half, b -> lower half
            regs[d] = (bf16_bits(src[0]) << 16) | bf16_bits(src[1])
        elif op == "prmt.b32":
            regs[d] = prmt(*src)
        elif op == "and.b32":
            regs[d] = src[0] & src[1]
        elif op == "or.b32":
            regs[d] = src[0] | src[1]
        elif op == "shr.b32":
            regs[d] = (src[0] & 0xFFFFFFFF) >> src[1]
        else:
            raise AssertionError(f"an instruction the emulator does not know: {op}")
    return regs


def test_the_byte_permute_lookup_gives_dequantize_4bits_weights_bit_for_bit():
    """The "prmt" lookup's PTX (per-row table of the 16 BF16 values, then byte permutes per pair of packed bytes),
    executed instruction by instruction with PTX's semantics: every code of both nibbles, at absmax values of many
    magnitudes (one subnormal), equals BF16(nf4[c] * absmax) as dequantize_4bit rounds it. (The GPU qualification
    checks the compiled kernel the same way; Triton's interpreter cannot run inline PTX.)"""
    pytest.importorskip("triton")
    import numpy as np
    import torch

    from engine import _nf4_triton as T
    from engine.nf4_kernels import NF4_TABLE

    table_asm, lookup_asm = T.TABLE_ASM.value, T.LOOKUP_ASM.value
    lut = np.array(NF4_TABLE, dtype=np.float32)
    gen = torch.Generator().manual_seed(0)
    absmax = [np.float32(v) for v in (torch.rand(40, generator=gen) * 10.0 ** torch.randint(-6, 2, (40,), generator=gen)).tolist()]
    absmax += [np.float32(1e-40), np.float32(1.0), np.float32(0.0)]
    checked = 0
    for a in absmax:
        planes = _run_ptx(table_asm, {"$8": a})
        ops = {}
        for i in range(4):  # two operands per plane register (one per packed element); the first is read
            for j in range(2):
                ops[f"${3 + 2 * i + j}"] = planes[f"${i}"]
                ops[f"${11 + 2 * i + j}"] = planes[f"${4 + i}"]
        for k in range(16):  # every code in both nibbles of both bytes, the two nibbles of a byte always unequal
            b0, b1 = (k << 4) | (15 - k), (((k + 3) % 16) << 4) | ((k + 6) % 16)
            out = _run_ptx(lookup_asm, {**ops, "$2": b0 | (b1 << 8)})
            got_even = (out["$0"] & 0xFFFF, out["$0"] >> 16)
            got_odd = (out["$1"] & 0xFFFF, out["$1"] >> 16)
            for i, byte in enumerate((b0, b1)):
                ref = torch.tensor([lut[byte >> 4] * a, lut[byte & 15] * a], dtype=torch.float32)
                want = (ref.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
                assert (got_even[i], got_odd[i]) == tuple(want), (a, byte)
                checked += 2
    assert checked == len(absmax) * 16 * 4
