from splitphase.hardware import cpuinfo

_TWO_CPUS = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: other
"""


def test_the_first_processor_block_is_read_alone() -> None:
    cpu = cpuinfo.first_processor(_TWO_CPUS)
    assert cpu["vendor_id"] == "AuthenticAMD" and cpu["model name"] == "AMD EPYC"
    assert (cpu["cpu family"], cpu["model"]) == ("25", "17")
    assert cpuinfo.first_processor("") == {}


def test_the_signature_tells_apart_cpus_of_one_name(monkeypatch) -> None:
    zen4 = cpuinfo.first_processor(_TWO_CPUS)
    monkeypatch.setattr(cpuinfo, "_first_cpu", lambda: zen4)
    assert cpuinfo.cpu_signature() == "AuthenticAMD 25/17"
    assert cpuinfo.cpu_vendor() == "AuthenticAMD" and cpuinfo.cpu_model_name() == "AMD EPYC"
    monkeypatch.setattr(cpuinfo, "_first_cpu", lambda: {**zen4, "model": "2"})  # Zen 5
    assert cpuinfo.cpu_signature() == "AuthenticAMD 25/2" and cpuinfo.cpu_model_name() == "AMD EPYC"
    monkeypatch.setattr(cpuinfo, "_first_cpu", dict)  # no /proc/cpuinfo
    assert cpuinfo.cpu_model_name() and cpuinfo.cpu_vendor() == ""


def test_avx512_needs_f_bw_and_vl(monkeypatch) -> None:
    zen3 = {"flags": "fpu sse2 avx avx2 fma bmi2"}
    monkeypatch.setattr(cpuinfo, "_first_cpu", lambda: zen3)
    assert "avx2" in cpuinfo.cpu_flags() and not cpuinfo.cpu_has_avx512()
    monkeypatch.setattr(cpuinfo, "_first_cpu", lambda: {"flags": "avx2 avx512f avx512bw"})
    assert not cpuinfo.cpu_has_avx512()  # no VL
    monkeypatch.setattr(cpuinfo, "_first_cpu", lambda: {"flags": "avx512f avx512bw avx512vl"})
    assert cpuinfo.cpu_has_avx512()
    monkeypatch.setattr(cpuinfo, "_first_cpu", dict)
    assert cpuinfo.cpu_flags() == frozenset() and not cpuinfo.cpu_has_avx512()


def test_bf16_instructions_are_any_of_avx512_bf16_amx_or_avx_ne_convert(monkeypatch) -> None:
    for flags, has in [("avx2 avx512f avx512bw avx512vl", False),  # Xeon VM hiding them
                       ("avx512f avx512bw avx512vl avx512_bf16", True),  # Zen 4/5
                       ("avx512f avx512_bf16 amx_bf16 amx_tile", True),
                       ("avx2 fma avx_ne_convert", True), ("avx2 fma", False)]:
        monkeypatch.setattr(cpuinfo, "_first_cpu", lambda flags=flags: {"flags": flags})
        assert cpuinfo.cpu_has_bf16_instructions() == has, flags
    monkeypatch.setattr(cpuinfo, "_first_cpu", dict)  # flags unknown: not ruled out
    assert cpuinfo.cpu_has_bf16_instructions()
