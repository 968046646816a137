"""The planner derives a step with the embedding offload from the step without it
(memtrain.estimator.derive): byte for byte what tracing it gives, on several families, with the
long-context techniques on and off, at every micro-batch and with held gradients."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from memtrain.config import load_recipe
from memtrain.estimator import derive
from memtrain.estimator import estimate as est
from memtrain.plan import planner
from memtrain.plan.search import EMBEDDINGS, Search
from memtrain.plan.space import with_values
from tests.conftest import TINY_CONFIGS, causal_recipe

ARCHS = {"llama": TINY_CONFIGS["llama"], "qwen2": TINY_CONFIGS["qwen2"],
         "gemma": {"model_type": "gemma", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 30522,
                   "max_position_embeddings": 256, "tie_word_embeddings": False},
         "gpt2": {**TINY_CONFIGS["gpt2"], "attn_pdrop": 0.0, "tie_word_embeddings": False},
         # 4 layers, 3 checkpointed: more than the 2-layer model that shows the table has
         "llama-4": {**TINY_CONFIGS["llama"], "num_hidden_layers": 4}}
# Gemma scales the looked-up rows in its embedding's own forward (a subclass): more host work than
# the derivation knows, so its step with the offload is traced (and the same)
TRACED = {"gemma"}
EVERY = {"checkpointing": "full", "loss": "chunked", "loss_chunk_tokens": 48, "tiled_mlp": True,
         "tiled_mlp_tile_tokens": 64, "lean_norm": True, "offload": {"activations": True}}


def _memory(arch: str, every: bool) -> dict[str, Any]:
    memory = copy.deepcopy(EVERY) if every else {}
    if arch == "gpt2":
        memory.pop("lean_norm", None)  # LayerNorm: nothing for the lean norm to replace
    if arch == "llama-4":
        memory = {"checkpointing": 3, "offload": {"activations": True}}
    return memory


def _estimates(search: Search, cfg: Any, held: bool) -> dict[tuple[int, int], Any]:
    """Every figure the search reads from the traces of ``cfg``, per (accumulation, micro-batch):
    at micro-batch 1 where the search allows no other (a long context), else at 1 (traced on its
    own beside others) and 2 to 4 (from the traces at 2 and 3)."""
    out = {}
    single = max(m for m, _ in search.batches) == 1
    for accumulation in (1, 2) if held else (1,):
        traced = search._traced(cfg, accumulation)
        for micro in (1,) if single else (1, 2, 3, 4):
            s = search._summary(traced, micro, accumulation)
            out[accumulation, micro] = (
                s.peak_bytes, s.total_bytes, s.by_category, s.by_phase, s.category_at_phase_peak,
                s.host_peak_bytes, s.host_resident_bytes, s.host_moved_bytes, s.overheads,
                s.settings["patches"], traced.counts2, traced.counts3)
    return out


def _compare(cfg: Any, monkeypatch: pytest.MonkeyPatch, derived_here: bool = True,
             held: bool = False) -> None:
    on = with_values(cfg, {EMBEDDINGS: True})
    derived_search = Search(cfg, "cuda", 2**40)
    offloads: list[bool] = []  # of each trace the derived search made
    for name in ("trace_candidates", "trace_candidates_at"):
        real = getattr(est, name)
        monkeypatch.setattr(est, name, lambda plan, *a, real=real, **k: (
            offloads.append(plan.cfg.memory.offload.embeddings), real(plan, *a, **k))[1])
    derived = _estimates(derived_search, on, held)
    monkeypatch.undo()
    assert offloads and any(offloads) is not derived_here  # derived: no trace with the offload
    # derived: the steps without the offload and those with it; else the latter traced
    assert len(derived_search.cache.traces) == (2 if held else 1) * (2 if derived_here else 1)
    with monkeypatch.context() as m:
        m.setattr(derive, "offloadable", lambda *a: False)
        traced = _estimates(Search(cfg, "cuda", 2**40), on, held)
    assert derived == traced


@pytest.mark.parametrize(("arch", "every", "micro"), [
    ("llama", True, "auto"), ("llama", True, 1), ("llama", False, "auto"),
    pytest.param("qwen2", True, "auto", marks=pytest.mark.long), ("gemma", True, "auto"),
    ("gpt2", False, "auto"),
    pytest.param("llama-4", True, "auto", marks=pytest.mark.long)])
def test_the_derived_step_is_the_traced_one(arch: str, every: bool, micro: Any, tmp_path: Path,
                                            tiny_text_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: no gather row (host peak of the steps without activation offload), the table's
    bytes left in the rounded column, no copy in the work, the record put first, Gemma's
    embedding subclass not excluded -> each fails one case or more."""
    batch = 4 if micro == "auto" else 1
    recipe = causal_recipe(tmp_path, tiny_text_file, memory=_memory(arch, every),
                           training={"micro_batch_size": micro, "effective_batch_size": batch,
                                     "gradient_accumulation": "auto" if micro == "auto" else 1})
    recipe["model"]["from_config"] = copy.deepcopy(ARCHS[arch])
    recipe["data"]["max_length"] = 64 if arch == "llama-4" else 192
    _compare(load_recipe(recipe), monkeypatch, arch not in TRACED, held=(arch, micro) == ("llama", "auto"))


@pytest.mark.long  # the causal-LM cases are in the suite
def test_a_classifier_step_is_derived_too(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_recipe("recipes/quickstart.yaml", ["training.micro_batch_size=auto"])
    _compare(cfg, monkeypatch, held=True)


def test_the_plan_traces_each_setting_once_for_both_values(tmp_path: Path, tiny_text_file: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """With `memory.offload.embeddings: auto` the search traces the settings without the offload
    and derives the ones with it: fewer traces, the same plan. Planted: no derivation -> more
    traces (the count fails)."""
    recipe = causal_recipe(tmp_path, tiny_text_file,
                           training={"micro_batch_size": 1, "effective_batch_size": 1,
                                     "gradient_accumulation": 1},
                           memory={"checkpointing": "auto", "offload": {"embeddings": "auto"}})
    cfg = load_recipe(recipe)
    traced: list[Any] = []
    real = est.trace_candidates

    def counted(plan: Any, *args: Any, **kwargs: Any) -> Any:
        traced.append(plan.cfg.memory.offload.embeddings)
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(est, "trace_candidates", counted)
    budget = 2**30
    derived = planner.plan(cfg, budget, device="cuda")
    assert traced and not any(traced)  # every trace without the offload
    count = len(traced)
    traced.clear()
    monkeypatch.setattr(derive, "offloadable", lambda *a: False)
    plain = planner.plan(cfg, budget, device="cuda")
    assert count < len(traced)
    assert derived.chosen.values == plain.chosen.values and derived.chosen.peak == plain.chosen.peak
    assert [(c.label(), c.peak, c.seconds) for c in derived.alternatives] == \
        [(c.label(), c.peak, c.seconds) for c in plain.alternatives]
