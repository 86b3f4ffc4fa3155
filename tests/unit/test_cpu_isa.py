"""replicas/cpu_isa.py: the level a flag set gives, and TETHER_CPU_ISA capping it (never raising it)."""

import pytest

from replicas import cpu_isa

AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.parametrize("flags, level", [(set(), "baseline"), ({"avx2", "fma"}, "baseline"), (AVX2, "avx2"),
                                          (AVX2 | {"avx512f"}, "avx2"), (AVX512, "avx512"),
                                          (AVX512 | {"avx512_bf16"}, "avx512_bf16"),
                                          (AVX2 | {"avx512_bf16"}, "avx2"),
                                          (AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}, "amx")])
def test_detected_level_needs_every_lower_level(flags, level):
    assert cpu_isa.detected_level(flags) == level


@pytest.fixture
def isa(monkeypatch):
    """cpu_isa() with this host's flags replaced and TETHER_CPU_ISA set as the test says."""
    def make(flags: set[str], override: str | None):
        monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: flags)
        if override is None:
            monkeypatch.delenv("TETHER_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("TETHER_CPU_ISA", override)
        cpu_isa.cpu_isa.cache_clear()
        return cpu_isa.cpu_isa()
    yield make
    cpu_isa.cpu_isa.cache_clear()


def test_override_caps_the_level_and_every_probe_follows(isa):
    assert isa(AVX512 | {"avx512_bf16"}, "avx2") == "avx2"
    assert not cpu_isa.fast_bf16() and not cpu_isa.bf16_weights_supported()
    assert cpu_isa.compiler_flags() == ["-mavx2", "-mfma", "-mf16c"]
    assert isa(AVX512 | {"avx512_bf16"}, None) == "avx512_bf16"
    assert cpu_isa.fast_bf16() and cpu_isa.bf16_weights_supported() and "-mavx512bf16" in cpu_isa.compiler_flags()


def test_override_never_raises_the_level(isa):
    assert isa(AVX2, "avx512_bf16") == "avx2"


def test_an_unknown_override_is_a_clear_error(isa):
    with pytest.raises(ValueError, match="TETHER_CPU_ISA='avx1024'"):
        isa(AVX2, "avx1024")
