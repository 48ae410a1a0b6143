"""The model, found for a script that names none (tracing by environment,
:class:`hvtrace.autotrace.ModelFinder`): the outermost module that holds the optimizer's
parameters, found at its first forward, its hooks then moved onto it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn.modules import module as torch_module  # noqa: E402

from hvtrace.autotrace import ModelFinder  # noqa: E402


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _finder(params: list) -> tuple[ModelFinder, list]:
    calls: list = []
    finder = ModelFinder(SimpleNamespace(param_groups=[{"params": params}]))
    finder.register_forward_pre_hook(lambda m, a: calls.append(("pre", type(m).__name__)))
    finder.register_forward_hook(lambda m, a, out: calls.append(("post", type(m).__name__)))
    return finder, calls


def test_the_outermost_module_holding_the_parameters_is_found_at_its_first_forward() -> None:
    frozen = nn.Linear(4, 4).requires_grad_(False)  # called first, holds no optimizer parameter
    net, loss = Net(), nn.MSELoss()
    finder, calls = _finder(list(net.parameters()))
    assert torch_module._global_forward_pre_hooks  # looking
    x = torch.randn(3, 4)
    for _ in range(3):
        loss(net(frozen(x)), torch.zeros(3, 2))
    assert finder.model is net
    # every forward of the model, the first included, and nothing of its children or the loss
    assert calls == [("pre", "Net"), ("post", "Net")] * 3
    assert not any(h is finder._look for h in torch_module._global_forward_pre_hooks.values())
    finder.close()
    net(x)
    assert len(calls) == 6  # the hooks moved onto the model are removed with it


def test_a_finder_whose_model_is_never_called_gives_up_and_removes_its_hook(monkeypatch) -> None:
    import hvtrace.autotrace as autotrace

    monkeypatch.setattr(autotrace, "FIND_MODEL_CALLS", 5)
    other, net = nn.Linear(4, 4), Net()
    finder, calls = _finder(list(net.parameters()))
    for _ in range(7):
        other(torch.randn(2, 4))
    assert finder.model is None and calls == []
    assert not any(h is finder._look for h in torch_module._global_forward_pre_hooks.values())


def test_removing_the_tracer_hooks_removes_the_global_hook() -> None:
    net = Net()
    finder = ModelFinder(SimpleNamespace(param_groups=[{"params": list(net.parameters())}]))
    handles = [
        finder.register_forward_pre_hook(lambda m, a: None),
        finder.register_forward_hook(lambda m, a, o: None),
    ]
    for h in handles:  # what the tracer does when it stops
        h.remove()
    assert not any(h is finder._look for h in torch_module._global_forward_pre_hooks.values())
