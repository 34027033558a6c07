"""The CPU's AMX probe reads torch's and is False where torch has none."""

from __future__ import annotations

import pytest
import torch

from splitphase.kernels import amx


def test_amx_probe_reads_torch_and_is_false_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert amx.cpu_has_amx_tiles()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert not amx.cpu_has_amx_tiles()
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert not amx.cpu_has_amx_tiles()
