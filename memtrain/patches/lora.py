"""LoRA adapters through peft; QLoRA when the base model is quantized.

Saves: the gradients and optimizer state of every frozen base weight (for AdamW, 12 of the 16
bytes per parameter of fp32 full fine-tuning). Costs: a little extra compute per adapted layer.
Follows Hu et al., 2021 (LoRA) and Dettmers et al., 2023 (QLoRA: 4-bit NF4 base, bf16 compute);
the implementation is peft's. On a quantized base the frozen weights stay in their loaded dtype
(``memory.lean_kbit``, as torchtune and Unsloth do) unless the recipe asks for peft's fp32 upcast.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model, prepare_model_for_kbit_training
from torch import nn
from torch.utils.checkpoint import checkpoint

from memtrain._compat.peft import check_forward_args, has_variant, quiet_renamed_checkpointing
from memtrain.config import AdapterConfig, Problem, RecipeError, RunConfig, decided
from memtrain.errors import first_line
from memtrain.memory import loops
from memtrain.model import CLASSIFIER_HEADS
from memtrain.patches import ADAPTER, Doc, Knob, NoMatchError, PatchRecord, add_records, register

Config = AdapterConfig

_TASKS = {"causal-lm": TaskType.CAUSAL_LM, "sequence-classification": TaskType.SEQ_CLS}


def is_quantized(model: nn.Module) -> bool:
    """True when the model's weights were loaded 4-bit or 8-bit by bitsandbytes."""
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def apply(model: nn.Module, cfg: AdapterConfig, task: str = "causal-lm", lean_kbit: bool = True) -> PeftModel:
    """Wrap ``model`` with LoRA adapters; only adapter (and head) parameters stay trainable.

    Args:
        model: a transformers model, possibly quantized by bitsandbytes (then this is QLoRA).
        cfg: rank, alpha, dropout and target modules.
        task: ``causal-lm`` or ``sequence-classification`` (the head is then trained in full).
        lean_kbit: on a quantized base, leave the frozen embeddings, head and norms in their
            loaded dtype (see :func:`prepare_lean`) instead of peft's fp32 upcast.
    """
    quantized = is_quantized(model)
    if quantized and not lean_kbit:
        # peft's QLoRA preparation: every non-quantized weight (norms, embeddings, the output
        # head) cast to fp32; memtrain's own checkpointing patch handles recompute, so peft's is off.
        with quiet_renamed_checkpointing():
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if cfg.target_modules != "all-linear":
        check_targets(model, list(cfg.target_modules))
    lora = LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        modules_to_save=cfg.modules_to_save,
        exclude_modules=[*_trained_in_full(model, cfg.modules_to_save, task),
                         *(_not_linear_outputs(model) if cfg.target_modules == "all-linear" else ())] or None,
        task_type=_TASKS[task],
    )
    try:
        with quiet_renamed_checkpointing():
            peft_model = get_peft_model(model, lora)
    except ValueError as err:  # peft's LoRA on a fused expert weight (Mixtral's, through its
        if cfg.dropout and "lora_dropout" in str(err):  # ParamWrapper) takes no dropout
            raise RecipeError([Problem("adapter.dropout", cfg.dropout, "LoRA on this model's fused expert "
                                       f"weights takes no dropout (peft: {first_line(err)})",
                                       "set `adapter.dropout: 0`.")]) from None
        if "incompatible with Mamba" in str(err):  # peft refuses LoRA on a Mamba mixer's projections
            raise RecipeError([Problem("adapter.target_modules", cfg.target_modules,
                                       f"peft cannot adapt some of these layers ({first_line(err)})",
                                       "list the layers to adapt without those, e.g. the attention and "
                                       "MLP projections (`memtrain validate` names the model's linear "
                                       "layers when a name matches none).")]) from None
        raise
    if quantized and lean_kbit:
        prepare_lean(peft_model)
    lean_lora_layers(peft_model, model_dtype=cfg.compute_dtype == "model")
    adapted = [name for name, module in peft_model.named_modules() if hasattr(module, "lora_A")
               and name.rsplit(".", 1)[-1] not in ("lora_A", "lora_B")]
    kind = "QLoRA" if quantized else "LoRA"
    lean = " (frozen weights kept in their dtype)" if quantized and lean_kbit else ""
    in_model_dtype = ", adapter matmuls in the model's dtype" if cfg.compute_dtype == "model" else ""
    detail = f"{kind} r={cfg.r} on {len(adapted)} layers{lean}{in_model_dtype}"
    add_records(peft_model, [PatchRecord("lora", adapted, detail)])
    return peft_model


def check_targets(model: nn.Module, targets: list[str]) -> None:
    """Every name of ``adapter.target_modules`` must match a module, as peft matches them (the whole
    name or its last dotted parts: ``q_proj``, ``self_attn.q_proj``).

    peft refuses only when *no* name matches, and then without the model's names; a misspelt name
    beside a right one would silently adapt fewer layers than the recipe says. So any name that
    matches nothing is refused, with the names of the model's linear layers.

    Raises:
        NoMatchError: naming ``adapter.target_modules``, each name that matched nothing, the names
            that did, and the distinct last names of the model's linear layers.
    """
    names = [name for name, _ in model.named_modules() if name]
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if not unmatched:
        return
    from transformers.pytorch_utils import Conv1D

    linear = list(dict.fromkeys(name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                                if isinstance(module, (nn.Linear, Conv1D))))
    matched = [t for t in targets if t not in unmatched]
    which = ", ".join(f"`{t}`" for t in unmatched)
    if matched:
        said = (f"{which} {'matches' if len(unmatched) == 1 else 'match'} no module of this model "
                f"({', '.join(f'`{t}`' for t in matched)} did). A name that matches nothing is refused, "
                "not skipped: a misspelt name would silently train fewer layers than the recipe says")
    else:
        said = f"no name matches a module of this model ({which})"
    raise NoMatchError(
        f"`adapter.target_modules`: {said}. This model's linear layers are named: "
        f"{', '.join(linear) or '(none)'}. Fix: correct or remove {which} (names from that list, "
        "matched as the end of a module's name), or set `adapter.target_modules: all-linear`.")


def _trained_in_full(model: nn.Module, modules_to_save: list[str] | None, task: str) -> list[str]:
    """Linear layers that peft will train in full (``modules_to_save``), which LoRA must leave alone.

    peft takes a module to save by the end of its name (``name.endswith(entry)``), so DistilBERT's
    ``pre_classifier`` goes with its ``classifier``: both are new layers of the head, trained in
    full. With ``all-linear`` peft would first give ``pre_classifier`` an adapter, then refuse it
    as a module to save ("modules_to_save cannot be applied to modules of type Linear").
    """
    from transformers.pytorch_utils import Conv1D

    saved = [*(modules_to_save or []), *(CLASSIFIER_HEADS if task == "sequence-classification" else ())]
    return [name for name, module in model.named_modules()
            if name and isinstance(module, (nn.Linear, Conv1D)) and any(name.endswith(s) for s in saved)]


def _not_linear_outputs(model: nn.Module) -> list[str]:
    """Layers of a model's own ``nn.Linear`` subclass whose forward returns more than a linear output,
    which ``all-linear`` must leave alone: LoRA adds its update to what the layer returns.

    Llama-4's and PhiMoE's routers are ``nn.Linear``s that return ``(scores, logits)``; peft's
    ``all-linear`` takes them, and the step fails adding a tensor to a tuple. Each such class (defined
    in transformers, with a forward of its own) is run once on one row of zeros to see what it returns.
    """
    verdicts: dict[type, bool] = {}
    found = []
    for name, module in model.named_modules():
        kind = type(module)
        if not (isinstance(module, nn.Linear) and kind.forward is not nn.Linear.forward
                and kind.__module__.startswith("transformers.")):
            continue
        if kind not in verdicts:
            try:
                with torch.no_grad():
                    out = module(torch.zeros(1, module.in_features, dtype=module.weight.dtype,
                                             device=module.weight.device))
                verdicts[kind] = not (isinstance(out, torch.Tensor) and out.shape[-1] == module.out_features)
            except Exception:  # it cannot run alone: leave it to peft, as before
                verdicts[kind] = False
        if verdicts[kind]:
            found.append(name)
    return found


def prepare_lean(model: nn.Module) -> int:
    """QLoRA without upcasting frozen weights: only what trains is made fp32.

    peft's ``prepare_model_for_kbit_training`` casts every bf16/fp16 weight that is not 4-bit to
    fp32: the embeddings and output head (2 GiB more on Llama-3.1-8B) and the norms, whose fp32
    weights also turn the hidden states after each norm into fp32. Nothing needs it for numerical
    reasons: transformers' RMSNorm/LayerNorm already compute their statistics in fp32 and cast back
    (as in plain bf16 training), and the loss upcasts logits to fp32. What does need fp32 is what
    the optimizer updates: LoRA weights (peft already keeps them fp32) and modules trained in full
    (``modules_to_save``, a classifier's head), cast here. tests/estimator/test_floor.py compares loss
    curves with peft's path.

    Returns:
        The number of trainable tensors cast to fp32.
    """
    cast = 0
    for param in model.parameters():
        if param.requires_grad and param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.float()
            cast += 1
    return cast


class _LowRank(torch.autograd.Function):
    """``F.linear(x.to(weight.dtype), weight)`` (``lora_A``) keeping ``x`` for backward as given.

    peft casts a layer's bf16 input to the fp32 adapter, and ``lora_A`` keeps that fp32 copy for
    its weight gradient: twice the bytes of the input, which the frozen base layer keeps anyway in
    bf16. Here the cast happens again in backward; casting bf16 to fp32 is exact, so the matmuls
    and their results are peft's.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return nn.functional.linear(x.to(weight.dtype), weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        x, weight = ctx.saved_tensors
        grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).to(weight.dtype)
        grad_x = (grad @ weight).to(x.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, grad_w


def _dropped_low_rank(x: torch.Tensor, weight: torch.Tensor, dropout: nn.Module) -> torch.Tensor:
    return nn.functional.linear(dropout(x.to(weight.dtype)), weight)


def _low_rank(x: torch.Tensor, weight: torch.Tensor, dropout: nn.Module) -> torch.Tensor:
    """``lora_A(dropout(x))`` as peft computes it (dropout on the fp32 copy, the same random mask),
    keeping only ``x`` for backward: with dropout, the region is recomputed in backward under the
    saved random state (non-reentrant checkpoint), so neither the fp32 copy nor the mask is kept."""
    if isinstance(dropout, nn.Identity) or not dropout.training:
        return _LowRank.apply(x, weight)
    if not torch.is_grad_enabled():
        return _dropped_low_rank(x, weight, dropout)
    return checkpoint(_dropped_low_rank, x, weight, dropout, use_reentrant=False)


class _LoraAdd(torch.autograd.Function):
    """``base + lora_B(low_rank) * scaling`` as peft computes it, without full-size fp32 tensors.

    peft's ``lora_B`` output, its scaled copy and the sum with the base output are fp32 tensors of
    the layer's full output size. Here the fp32 work runs over chunks of rows. The arithmetic is
    peft's: the same fp32 matmuls, the same fp32 sum rounded once to the output dtype (or, where
    peft rounds the adapter's output first, as for bitsandbytes layers, that too).
    """

    @staticmethod
    def forward(ctx: Any, base: torch.Tensor, low_rank: torch.Tensor, weight_b: torch.Tensor,
                scaling: float, round_first: bool) -> torch.Tensor:
        out = torch.empty_like(base)
        rows = _chunk_rows(base)
        flat_base, flat_h = base.reshape(-1, base.shape[-1]), low_rank.reshape(-1, low_rank.shape[-1])
        flat_out = out.view(-1, out.shape[-1])
        for _, start, stop in loops.chunks("lora_add", flat_out.shape[0], rows, keep=loops.LEAN_KEEP):
            piece = nn.functional.linear(flat_h[start:stop], weight_b) * scaling
            part = flat_base[start:stop]
            flat_out[start:stop] = (part + piece.to(base.dtype) if round_first
                                    else part.to(piece.dtype) + piece)
        ctx.save_for_backward(weight_b, low_rank)
        ctx.scaling = scaling
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        weight_b, low_rank = ctx.saved_tensors
        flat_g, flat_h = grad.reshape(-1, grad.shape[-1]), low_rank.reshape(-1, low_rank.shape[-1])
        grad_h = torch.empty_like(flat_h)
        grad_b = torch.zeros_like(weight_b)
        rows = _chunk_rows(grad)
        for _, start, stop in loops.chunks("lora_add_backward", flat_g.shape[0], rows, keep=loops.LEAN_KEEP):
            g = flat_g[start:stop].to(weight_b.dtype) * ctx.scaling
            grad_b += g.t() @ flat_h[start:stop]
            grad_h[start:stop] = g @ weight_b
        return grad, grad_h.view(low_rank.shape), grad_b, None, None


CHUNK_BYTES = 32 * 2**20  # fp32 bytes of one chunk of a layer's output


def _chunk_rows(out: torch.Tensor) -> int:
    return max(1, CHUNK_BYTES // (4 * out.shape[-1]))


def _lean_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's LoRA ``Linear.forward`` for plain adapters, through :func:`_low_rank` and
    :class:`_LoraAdd`; anything else (adapters off or merged, mixed batches, DoRA and other
    variants, autocast, adapter layers that another patch replaced, such as the
    randomized-backward linear) is peft's own."""
    plain = not (self.disable_adapters or self.merged or torch.is_autocast_enabled()
                 or kwargs.get("adapter_names") is not None
                 or has_variant(self, self.active_adapters)
                 or any(type(m[a]) is not nn.Linear for m in (self.lora_A, self.lora_B)
                        for a in self.active_adapters if a in m))
    if not plain:
        return type(self).forward(self, x, *args, **kwargs)
    check_forward_args(self, x, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs)
    if getattr(self, "adapter_in_model_dtype", False) and result.dtype != torch.float32:
        return _model_dtype_adapters(self, x, result)
    for name in self.active_adapters:
        if name not in self.lora_A:
            continue
        lora_a, lora_b = self.lora_A[name], self.lora_B[name]
        low_rank = _low_rank(x, lora_a.weight, self.lora_dropout[name])
        result = _LoraAdd.apply(result, low_rank, lora_b.weight, self.scaling[name],
                                self.round_adapter_first)
    return result


def _model_dtype_adapters(self: nn.Module, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """``adapter.compute_dtype: model``: each adapter in the base output's dtype, its output added
    with one ``addmm`` (no full-size fp32 tensor, no row chunks), the fp32 weights cast for the
    matmuls (their gradients flow back through the casts into fp32), as autocast computes peft's
    adapter and Unsloth its own."""
    dtype, shape = result.dtype, result.shape
    flat = result.reshape(-1, shape[-1])
    for name in self.active_adapters:
        if name not in self.lora_A:
            continue
        # peft's low rank on the weight cast to the model's dtype (x is already in it)
        low_rank = _low_rank(x, self.lora_A[name].weight.to(dtype), self.lora_dropout[name])
        flat = torch.addmm(flat, low_rank.reshape(-1, low_rank.shape[-1]),
                           self.lora_B[name].weight.to(dtype).t(), alpha=self.scaling[name])
    return flat.view(shape)


def lean_lora_layers(model: nn.Module, model_dtype: bool = False) -> int:
    """Route every plain peft LoRA linear layer through :class:`_LoraAdd` (exact, less memory), or,
    with ``model_dtype`` (``adapter.compute_dtype: model``), through
    :func:`_model_dtype_adapters` on a bf16/fp16 base.

    Covers peft's ``Linear`` and its bitsandbytes ``Linear4bit``/``Linear8bitLt`` (which round the
    adapter's output to the output dtype before adding it); layers whose adapters have a bias are
    left to peft. Returns the number of layers changed.
    """
    from peft.tuners.lora import layer as lora_layer

    kinds: dict[type, bool] = {lora_layer.Linear: False}
    try:
        from peft.tuners.lora import bnb as lora_bnb

        kinds.update({cls: True for cls in (getattr(lora_bnb, "Linear4bit", None),
                                           getattr(lora_bnb, "Linear8bitLt", None)) if cls})
    except ImportError:  # bitsandbytes not installed
        pass
    changed = 0
    for module in model.modules():
        round_first = kinds.get(type(module))
        if round_first is None or "forward" in module.__dict__:
            continue
        if any(m.bias is not None for m in (*module.lora_A.values(), *module.lora_B.values())):
            continue
        module.round_adapter_first = round_first
        module.adapter_in_model_dtype = model_dtype
        module.forward = types.MethodType(_lean_forward, module)
        changed += 1
    return changed


# DPO's reference is the base with the adapter disabled: a LoRA run (config/checks.py). The adapter is
# the model being trained, kept in a plain trace (base), and not counted as a memory technique.
# plugin=False: a user's model is its own adapter (a peft model, or TRL's `peft_config=`), described
# to the planner, never wrapped again by memtrain.
KNOBS = (Knob("adapter.method",
              lambda cfg, shape: ["lora"] if cfg.training.objective == "dpo" else ["full", "lora"],
              "full", order=20, base=True, technique=False),)
DOC = Doc("LoRA (peft)", "`adapter.method: lora`", "trainable weights and their optimizer state",
          "[techniques](docs/techniques.md)")


@register("lora", ADAPTER, "adapter", config=Config, apply=apply, knobs=KNOBS, doc=DOC)
def _from_recipe(model: nn.Module, cfg: RunConfig) -> nn.Module | None:
    if decided(cfg.adapter.method, "adapter.method", "lora or full") != "lora":
        return None
    return apply(model, cfg.adapter, cfg.model.task, cfg.memory.lean_kbit)
