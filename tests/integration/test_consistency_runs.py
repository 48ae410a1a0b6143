"""Ranks that stop training the same model, on real ``horovodrun`` jobs (2 ranks, Gloo).

Each failure mode is injected into ``hvtrace.examples.train`` (a 4-layer, 256-wide MLP, 24 steps,
parameters fingerprinted every 5 steps) and the analysis must name the step and what differs:

- weights changed on rank 1 alone before step 7 (``--perturb-rank``): the parameters differ at
  the check of step 10 (equal at step 5), in the perturbed tensor only;
- rank 1 halves its learning rate before step 12 (``--lr-skew-rank``: a scheduler stepped on one
  rank) and records another value of a scalar marked ``agree=True`` from step 18: ``lr`` differs
  from step 12 (0.02 vs 0.01), the parameters from the check of step 15, ``lr_scale`` from 18;
- ``hvd.broadcast_parameters`` left out with a different seed per rank: the parameters differ at
  step 0, and the report says the broadcast is missing;
- a normal run with a check every step stays clean, and its parameters are bit-identical to
  those of the same run without hvtrace.

With pytorch-lightning installed, also the issue's own case: ``ReduceLROnPlateau`` monitoring a
``val_loss`` logged without ``sync_dist`` on validation shards that differ (3 epochs).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import analyze_cli, ran_steps, run_horovodrun, scenario, tail, traced_scenario

from hvtrace.analysis.summary import analyze
from hvtrace.load import load_run

pytestmark = [pytest.mark.horovod, pytest.mark.timeout(900)]

STEPS = 24
COMMON = ["--steps", str(STEPS), "--width", "256", "--layers", "4", "--batch-size", "64"]
TENSORS = {f"net.{i}.{k}" for i in (0, 2, 4, 6, 8) for k in ("weight", "bias")}


PERTURBED = traced_scenario(
    "consistency_perturbed", *COMMON, "--consistency-every", "5",
    "--perturb-rank", "1", "--perturb-step", "7", "--perturb-tensor", "net.2.weight",
)  # fmt: skip
LR_SKEW = traced_scenario(
    "consistency_lr", *COMMON, "--consistency-every", "5",
    "--lr-skew-rank", "1", "--lr-skew-step", "12",
    "--agree-skew-rank", "1", "--agree-skew-step", "18",
)  # fmt: skip
NO_BROADCAST = traced_scenario(
    "consistency_nobcast", *COMMON, "--consistency-every", "5", "--no-broadcast", "--rank-seed"
)
#: The same job checked at every step, and without hvtrace: their parameters are compared.
CHECKED = traced_scenario(
    "consistency_checked", *COMMON, "--consistency-every", "1", "--save-params", "{base}/params.pt",
    "--save-model", "{base}/model.pt",
)  # fmt: skip
PLAIN = scenario("consistency_plain", *COMMON, "--no-trace", "--save-params", "{base}/params.pt")


def _divergences(trace: Path) -> tuple[object, dict[str, object]]:
    a = analyze(load_run(trace))
    divs = [f for f in a.findings if f.kind == "divergence"]
    by_what = {f.data["what"]: f for f in divs}
    assert len(by_what) == len(divs), [f.message for f in divs]
    return a, by_what


@pytest.fixture(scope="module")
def perturbed(batched) -> Path:
    return ran_steps(batched(PERTURBED), STEPS)


def test_weights_changed_on_one_rank_are_named_at_the_next_check(perturbed: Path) -> None:
    a, divs = _divergences(perturbed)
    assert set(divs) == {"parameters"}, [f.message for f in a.findings]
    d = divs["parameters"]
    assert d.data["step"] == 10 and d.data["last_equal_step"] == 5
    assert d.data["names"] == ["net.2.weight"] and d.data["ranks"] == [1]
    assert a.findings[0] is d  # first: no hang, nothing else before it
    c = a.consistency
    assert c["parameters"]["steps"] == [0, 5, 10, 15, 20]
    assert c["parameters"]["tensors"] == len(TENSORS)
    assert c["lr"] == {"steps": STEPS, "groups": 1}


def test_analyze_command_reports_it_first_and_in_json(perturbed: Path, tmp_path: Path) -> None:
    js = tmp_path / "a.json"
    p = analyze_cli(perturbed, "--json", js)
    assert p.returncode == 0, p.stderr
    head = p.stdout[: p.stdout.index("Where each step's time goes")]
    assert "! divergence at step 10" in head and "net.2.weight" in head, p.stdout
    doc = json.loads(js.read_text())
    assert doc["findings"][0]["kind"] == "divergence"
    assert doc["findings"][0]["data"]["step"] == 10
    assert doc["consistency"]["parameters"]["checks"] == 5
    assert doc["consistency"]["divergences"][0]["names"] == ["net.2.weight"]


def test_the_dashboard_shows_the_divergence(perturbed: Path) -> None:
    pytest.importorskip("dash")
    from dashboard.app import DashboardData

    data = DashboardData.from_run(load_run(perturbed))
    assert data.findings[0].startswith("⚠ divergence at step 10"), data.findings


def test_learning_rates_and_agreed_values_driven_apart(batched) -> None:
    trace = ran_steps(batched(LR_SKEW), STEPS)
    a, divs = _divergences(trace)
    assert set(divs) == {"lr", "parameters", "values"}, [f.message for f in a.findings]
    lr = divs["lr"]
    assert (lr.data["step"], lr.data["names"], lr.data["ranks"]) == (12, ["lr"], [1])
    assert lr.data["values"]["0"] == {"0": 0.02, "1": 0.01}
    assert lr.data["steps_differing"] == STEPS - 12
    assert divs["parameters"].data["step"] == 15  # the first check after the update of 12
    assert divs["parameters"].data["last_equal_step"] == 10
    val = divs["values"]
    assert (val.data["step"], val.data["names"]) == (18, ["lr_scale"])
    assert val.data["values"]["lr_scale"] == {"0": 1.0, "1": 2.0}
    # ordered by step, right at the top
    assert [f.data["what"] for f in a.findings[:3]] == ["lr", "parameters", "values"]


def test_missing_broadcast_is_named_at_step_zero(batched) -> None:
    trace = ran_steps(batched(NO_BROADCAST), STEPS)
    a, divs = _divergences(trace)
    d = divs["parameters"]
    assert d.data["step"] == 0 and d.data["first_check"] == 0
    assert set(d.data["names"]) == TENSORS  # every tensor was initialized differently
    assert "hvd.broadcast_parameters" in d.message
    assert a.findings[0] is d


def test_a_normal_run_is_clean_and_bit_identical_with_checks_every_step(batched) -> None:
    checked = batched(CHECKED)
    traced = ran_steps(checked, STEPS)
    plain = batched(PLAIN)
    assert f"rank 0: {STEPS} steps" in plain.stdout, tail(plain.stderr)
    a, divs = _divergences(traced)
    assert divs == {}, [f.message for f in a.findings]
    assert a.consistency["parameters"]["checks"] == STEPS
    x = torch.load(checked.base / "params.pt", map_location="cpu", weights_only=True)
    y = torch.load(plain.base / "params.pt", map_location="cpu", weights_only=True)
    assert set(x) == set(y) and len(x) == len(TENSORS)
    for k in x:
        assert torch.equal(x[k], y[k]), k
    # rank 0 saved the traced model whole and a deep copy of it (its forward hooks, the
    # tracer's and the batch fingerprint's, go inert in both): they load with nothing of
    # hvtrace's recorder (the model's class is hvtrace's demo's), and train
    load = (
        "import pickle, types, torch\n"
        "class Unpickler(pickle.Unpickler):\n"
        "    def find_class(self, module, name):\n"
        "        assert not module.startswith('hvtrace.record'), (module, name)\n"
        "        return super().find_class(module, name)\n"
        "pm = types.ModuleType('restricted')\n"
        "pm.Unpickler, pm.load = Unpickler, pickle.load\n"
        f"models = torch.load({str(checked.base / 'model.pt')!r}, weights_only=False,"
        " pickle_module=pm)\n"
        "for m in models:\n"
        "    m(torch.randn(2, 256)).sum().backward()\n"
        f"    s, x = m.state_dict(), torch.load({str(checked.base / 'params.pt')!r})\n"
        "    assert set(s) == set(x) and all(torch.equal(s[k], x[k]) for k in x), sorted(s)\n"
        "print(len(models))"
    )
    p = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "2", p.stderr[-2000:]


@pytest.mark.skipif(
    importlib.util.find_spec("pytorch_lightning") is None,
    reason="pytorch-lightning is not installed (pip install -e '.[lightning]')",
)
def test_lightning_plateau_scheduler_on_an_unsynced_val_loss(tmp_path: Path) -> None:
    """The issue's case: 3 epochs of 10 steps, validation at each epoch's end on each rank's own
    shard, ``val_loss`` logged without ``sync_dist``, a ``ReduceLROnPlateau`` on it."""
    trace = tmp_path / "trace"
    cmd = [sys.executable, "-m", "hvtrace.examples.train_lightning", "--steps", "30"]
    cmd += ["--epochs", "3", "--width", "64", "--layers", "2", "--batch-size", "32"]
    cmd += ["--val-every", "10", "--plateau", "--val-unsynced", "--consistency-every", "5"]
    proc = run_horovodrun([*cmd, "--trace-dir", str(trace)], cwd=tmp_path)
    assert "rank 0: 30 steps" in proc.stdout, tail(proc.stderr)
    a, divs = _divergences(trace)
    mon = divs["values"]  # the value the scheduler was stepped with, at the first epoch's end
    assert mon.data["step"] == 9 and mon.data["monitored"] == ["val_loss"], mon.message
    assert mon.severity == "warning"
    assert divs["metrics"].severity == "info" and "val_loss" in divs["metrics"].data["names"]
    # the scheduler then lowered rank 1's learning rate alone, and the weights followed
    lr = divs["lr"]
    assert lr.data["step"] > 9 and lr.data["names"] == ["lr"] and lr.data["ranks"] == [1]
    assert divs["parameters"].data["step"] > lr.data["step"]
    assert a.findings[0] is mon
