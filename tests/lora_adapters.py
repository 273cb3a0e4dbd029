"""Random LoRA adapters made by peft on the tiny family models (tests/family_models.py), saved
in peft's format, and peft's own greedy output with them: the reference the adapter tests hold
gapless to."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

# the projections a family's checkpoints name (Phi-3 holds q/k/v and gate/up joined)
TARGETS = {
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
}
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# name -> LoraConfig arguments beyond the targets: plain, patterned, rsLoRA, all-linear
KINDS = {
    "plain": dict(r=8, lora_alpha=16),
    "patterned": dict(r=4, lora_alpha=8, rank_pattern={"layers.0.self_attn.o_proj": 2,
                      "down_proj": 16}, alpha_pattern={"o_proj": 3, "layers.1.mlp.down_proj": 40}),
    "rslora": dict(r=16, lora_alpha=8, use_rslora=True),
    "all-linear": dict(r=2, lora_alpha=4, target_modules="all-linear"),
}  # fmt: skip


def make_adapter(base, family: str, out: Path, kind: str, seed: int):
    """A peft adapter of `kind` on base (a transformers model), B not zero, saved in out; the
    PeftModel (float32, eval), on a copy of base."""
    from peft import LoraConfig, get_peft_model

    args = dict(KINDS[kind])
    args.setdefault("target_modules", TARGETS.get(family, LINEAR))
    config = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **args)
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # B large enough that the adapter changes the greedy tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    return model.float().eval()


def scores(model, prompt: list[int], output: list[int]) -> tuple[list[int], list[float]]:
    """What transformers' model, given prompt and then output, would choose greedily at each
    of output's positions, and the logprob it gives output's token there: one forward pass
    (generate's own loop over peft's layers costs seconds a request here). Output equals
    greedy decoding exactly when the choices are output itself."""
    ids = torch.tensor([prompt + output[:-1]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 :].float()
    logprobs = logits.log_softmax(-1)
    chosen = logprobs.argmax(-1).tolist()
    return chosen, logprobs[torch.arange(len(output)), torch.tensor(output)].tolist()


def greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens after prompt (generate) and each one's logprob."""
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    new = out.sequences[0, len(prompt) :].tolist()
    steps = torch.cat(out.logits).float().log_softmax(-1)
    return new, steps[torch.arange(len(new)), new].tolist()
