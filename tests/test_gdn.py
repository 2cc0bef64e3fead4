"""engine/gdn.py: the qualification that decides whether a fla GDN kernel runs. CPU: the conv harness passes the
PyTorch reference against itself and rejects kernels that are wrong in the ways a kernel goes wrong (a shifted
window, a dropped activation, a state not updated in place); install on a CPU picks the reference everywhere. GPU
(`gpu` marker): fla's conv and conv_update qualify at the 27B head layout and run inside the stock module."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import gdn

SMALL = {"hk": 2, "hv": 4, "dk": 16, "dv": 16, "w": 4}


def test_reference_qualifies_against_itself():
    for name, T in (("conv", 64), ("conv_update", 1)):
        r = gdn.qualify_conv(name, gdn.reference(name), T, SMALL, torch.device("cpu"))
        assert r["passed"], r
        keys = {"o", "dx", "dw"} if name == "conv" else {"o", "state"}
        assert set(r["rel_l2"]) == keys
        assert all(0 <= v < 1e-2 for v in r["torch_bf16_rel_l2"].values()), r  # BF16 against FP32: small, not zero
        assert any(v > 0 for v in r["torch_bf16_rel_l2"].values()), r


def _shifted(hidden_states, weight, bias=None, activation=None, **kwargs):
    """Off by one token: the window reads one position too far back."""
    out = gdn.reference("conv")(hidden_states, weight, bias, activation=activation)
    return F.pad(out, (1, 0))[..., :-1]


def _no_silu(hidden_states, weight, bias=None, activation=None, **kwargs):
    return gdn.reference("conv")(hidden_states, weight, bias, activation=None)


def _state_copied(hidden_states, conv_state, weight, bias=None, activation=None):
    """Right output, but the state updated on a copy (what a contiguity guard does to a strided state)."""
    return gdn.reference("conv_update")(hidden_states, conv_state.clone(), weight, bias, activation)


@pytest.mark.parametrize("name,fn,T", [("conv", _shifted, 64), ("conv", _no_silu, 64),
                                       ("conv_update", _state_copied, 1)])
def test_wrong_kernels_do_not_qualify(name, fn, T):
    r = gdn.qualify_conv(name, fn, T, SMALL, torch.device("cpu"))
    assert not r["passed"], r


def test_install_on_cpu_runs_the_reference_everywhere():
    from types import SimpleNamespace

    cfg = SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=16, linear_conv_kernel_dim=4)
    chosen = gdn.install("auto", cfg, "cpu")
    assert chosen == {"chunk": "torch", "recurrent": "torch", "conv": "torch", "conv_update": "torch"}
    with pytest.raises(RuntimeError, match="do not qualify"):
        gdn.install("fla", cfg, "cpu")
    gdn.install("torch", cfg, "cpu")


@pytest.mark.gpu
def test_fla_conv_kernels_qualify_and_run_in_the_module():
    """At the 27B layout fla's conv and conv_update qualify; inside transformers' GDN module (installed by
    gdn.install) a sequence forward+backward and a cached one-token step match the reference within the rule."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("fla")
    dev = torch.device("cuda")
    layout = {"hk": 16, "hv": 48, "dk": 128, "dv": 128, "w": 4}
    fns = gdn.fla_functions()
    for name, T in (("conv", 4096), ("conv", 8192), ("conv_update", 1)):
        r = gdn.qualify_conv(name, fns[name], T, layout, dev, seed=T)
        assert r["passed"], r
    # a strided state falls back to the reference and still updates in place
    st = torch.randn(2, 10240, 8, device=dev, dtype=torch.bfloat16)[..., ::2]
    ref_st = st.clone()
    x = torch.randn(2, 10240, 1, device=dev, dtype=torch.bfloat16)
    w = torch.randn(10240, 4, device=dev, dtype=torch.bfloat16)
    out = fns["conv_update"](x, st, w, None, "silu")
    ref = gdn.reference("conv_update")(x, ref_st, w, None, "silu")
    assert torch.equal(out, ref) and torch.equal(st, ref_st)
