"""One test of a trainer's kind (memtrain._compat.trl.is_trl), shared by the estimator, the plugin and
the reliability layer (it was spelled three ways: isinstance after importing TRL, a private copy of
this MRO test, and ``generation_steps(...) is not None``)."""

from __future__ import annotations

from memtrain._compat.trl import generation_steps, is_grpo, is_trl


def _trainer_class(name: str, module: str) -> type:
    return type(name, (), {"__module__": module})


def test_a_trainer_is_trls_by_class_name_and_module_through_subclasses() -> None:
    grpo = _trainer_class("GRPOTrainer", "trl.trainer.grpo_trainer")
    mine = type("MyGRPO", (grpo,), {"__module__": "my_project"})
    assert is_grpo(grpo()) and is_grpo(mine()) and is_trl(mine(), "GRPOTrainer")
    assert not is_trl(mine(), "DPOTrainer")
    impostor = _trainer_class("GRPOTrainer", "trlx.trainer")  # another library's class of that name
    assert not is_grpo(impostor()) and generation_steps(impostor()) is None
    assert not is_grpo(object())
