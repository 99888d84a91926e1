"""The profile schema: round trip through JSON, the shipped profiles load, bad documents are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sim_profiles import make_profile

from pdserve.engine.sim_profile import PROFILE_VERSION, Overhead, Profile, load_profile

SHIPPED = sorted((Path(__file__).resolve().parents[2] / "capacity" / "profiles").glob("*.json"))


def test_round_trip_through_a_file(tmp_path: Path) -> None:
    profile = make_profile(
        prefill=(0.01, 2e-5, 3e-9),
        decode=(0.005, 1e-4, 5e-8),
        transfer_s=0.002,
        overhead=Overhead(0.001, 0.01, per_seq_s=2e-4, jitter_sigma=1.5, wake_s=0.004, wake_sigma=2.2, pass_sigma=0.17),
        name="round-trip",
    )
    path = tmp_path / "p.json"
    profile.save(path)
    assert load_profile(path) == profile
    assert Profile.from_json(json.loads(path.read_text())).to_json() == profile.to_json()


def test_shipped_profiles_load_and_cite_their_source() -> None:
    assert len(SHIPPED) >= 2
    for path in SHIPPED:
        profile = load_profile(path)
        assert Profile.from_json(profile.to_json()) == profile
        assert profile.source, f"{path.name} must say where its numbers come from"
    gpu = load_profile(next(p for p in SHIPPED if "h100" in p.name))
    assert "http" in gpu.source and gpu.device["gpu"].startswith("NVIDIA H100")


def test_pass_model_mixes_prefill_and_decode() -> None:
    p = make_profile(prefill=(0.01, 0.001, 1e-6), decode=(0.004, 0.002, 1e-5))
    assert p.pass_s([(100, 0)], 0, 0) == pytest.approx(0.01 + 0.1 + 1e-6 * 100 * 100)
    assert p.pass_s([(50, 100)], 0, 0) == pytest.approx(0.01 + 0.05 + 1e-6 * 50 * 150)  # chunk on a cached prefix
    assert p.pass_s([], 4, 400) == pytest.approx(0.004 + 0.008 + 0.004)
    mixed = p.pass_s([(100, 0)], 4, 400)  # the constant term is paid once
    assert mixed == pytest.approx(p.pass_s([(100, 0)], 0, 0) + p.pass_s([], 4, 400) - 0.004)
    assert p.transfer_s("shm", 1000) == pytest.approx(0.0)


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda d: d.update(version=PROFILE_VERSION + 1), "version"),
        (lambda d: d.update(format="other"), "format"),
        (lambda d: d.pop("decode"), "decode"),
        (lambda d: d["prefill"].update(coef=[1.0, -1.0, 0.0]), "prefill.coef"),
        (lambda d: d["engine"].update(max_num_seqs=0), "engine.max_num_seqs"),
        (lambda d: d["transfer"].update(nvlink={"latency_s": 0, "bytes_per_s": 1}), "transfer"),
    ],
)
def test_bad_documents_name_the_field(change, field: str) -> None:  # noqa: ANN001
    doc = make_profile().to_json()
    change(doc)
    with pytest.raises(ValueError, match=field.split(".")[0]):
        Profile.from_json(doc)


def test_load_profile_refuses_non_json(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_profile(bad)


def test_overhead_of_an_older_profile_reads_zero_for_the_new_terms() -> None:
    over = Overhead.from_json({"per_pass_s": 0.01, "per_request_s": 0.05})
    assert over == Overhead(0.01, 0.05) and over.per_seq_s == 0.0 and over.jitter_sigma == 0.0
    assert over.wake_s == 0.0 and over.wake_sigma == 0.0  # no per-pass delay unless the profile says so
    assert over.pass_sigma == 0.0  # nor a spread of the pass model's time
    assert over.pass_s(10) == pytest.approx(0.01)
    assert Overhead(0.01, 0.0, per_seq_s=0.001).pass_s(10) == pytest.approx(0.02)
    with pytest.raises(ValueError):
        Overhead(per_seq_s=-1.0)
    with pytest.raises(ValueError):
        Overhead(wake_s=-1e-3)
    with pytest.raises(ValueError):
        Overhead(pass_sigma=-0.1)
