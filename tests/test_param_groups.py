"""Optimizer states of every parameter-group shape a user's loop makes: saved, and resumed to the
same next step as a run that never stopped; a state that could not be loaded back is refused
at its save, naming the group."""

from __future__ import annotations

import pytest
import torch

from dcpkit import CheckpointConfig, CheckpointError, CheckpointManager


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 6))


def _step(model, opt, step: int) -> None:
    torch.manual_seed(100 + step)
    opt.zero_grad()
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()


def _lora_like(model):  # the Trainer's groups under LoRA: the no-decay group is empty
    return torch.optim.AdamW(
        [{"params": list(model.parameters()), "weight_decay": 0.1}, {"params": [], "lr": 0.5}],
        lr=1e-2,
    )


def _empty_first(model):
    return torch.optim.AdamW([{"params": [], "lr": 7.0}, {"params": list(model.parameters())}])


def _frozen(model):
    model[1].requires_grad_(False)  # in the optimizer, never stepped
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _added_later(model):
    opt = torch.optim.SGD(model[0].parameters(), lr=1e-2, momentum=0.9)
    opt.add_param_group({"params": list(model[1].parameters()), "lr": 5e-3})
    return opt


def _only_empty(model):
    return torch.optim.SGD([{"params": [], "lr": 3.0}], lr=0.1)


@pytest.mark.parametrize(
    "make", [_lora_like, _empty_first, _frozen, _added_later, _only_empty], ids=lambda f: f.__name__
)
def test_every_group_shape_resumes_to_the_same_next_step(make, tmp_path):
    config = CheckpointConfig(enable=True, folder=str(tmp_path / "checkpoint"), interval=1)
    model = _model()
    opt = make(model)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)  # sets every group's lr
    with CheckpointManager(config, tmp_path, model, optimizer=opt, lr_scheduler=scheduler) as m:
        for step in (1, 2):
            _step(model, opt, step)
            scheduler.step()
            m.save(step)
    _step(model, opt, 3)  # the run that never stopped
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]

    model = _model()
    opt = make(model)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    with CheckpointManager(config, tmp_path, model, optimizer=opt, lr_scheduler=scheduler) as m:
        assert m.load() == 2
    assert [len(g["params"]) for g in opt.param_groups] == [
        len(g["params"]) for g in make(_model()).param_groups
    ]
    _step(model, opt, 3)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_an_optimizer_holding_a_tensor_that_is_not_the_models_is_refused_at_its_save(tmp_path):
    model = _model()
    stray = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([{"params": list(model.parameters())}, {"params": [stray]}])
    config = CheckpointConfig(enable=True, folder=str(tmp_path / "checkpoint"), interval=1)
    with CheckpointManager(config, tmp_path, model, optimizer=opt) as m:
        _step(model, opt, 1)
        with pytest.raises(CheckpointError, match=r"parameter group 1 holds a parameter of shape"):
            m.save(1)
        assert m.published_steps() == []
