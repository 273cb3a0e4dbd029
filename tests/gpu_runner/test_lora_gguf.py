"""LoRA adapters in llama.cpp's GGUF format, against the peft files they were converted from
(tests/fixtures/README.md: a peft adapter on the tiny Llama, converted by llama.cpp's
convert_lora_to_gguf.py): the same pairs and scales, the same greedy tokens and logprobs as
transformers + peft with those files, in a batch mixed with peft and base requests; GGUF files
that are not a LoRA adapter for this model are refused, naming the file and the cause."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from gapless.common.messages import LoadLora, LoraAdapters, SamplingParams
from gapless.common.model_files import load_arch, resolve_model
from gapless.gpu_runner.lora.adapter import AdapterError, load_adapter
from tests.engine_harness import Recorder, make_config
from tests.family_models import build
from tests.lora_adapters import scores

pytest.importorskip("peft")
gguf = pytest.importorskip("gguf")

FIXTURES = Path(__file__).parent.parent / "fixtures"
PEFT, GGUF = FIXTURES / "tiny-llama-lora", FIXTURES / "tiny-llama-lora.gguf"
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
PROMPT = [36424, 23833, 19866, 24255, 77, 21367, 32402, 36927, 25642]


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tiny_model_dir):
    """(model dir, transformers' model): the tiny Llama the fixture's adapter was made on."""
    out = tmp_path_factory.mktemp("lora_gguf") / "model"
    return out, build("llama", out, tiny_model_dir)


@pytest.fixture(scope="module")
def peft_ref(llama):
    """transformers + peft with the files the GGUF was converted from."""
    from peft import PeftModel

    return PeftModel.from_pretrained(llama[1], PEFT).float().eval()


@pytest.fixture(scope="module")
def arch(llama):
    return load_arch(resolve_model(str(llama[0])))


def test_the_gguf_holds_the_peft_files_pairs_and_scales(arch):
    """Every projection's A and B (q and k rows put back in Hugging Face's order) and the
    scale alpha / r, as the peft files give them."""
    peft, ours = load_adapter("p", PEFT, arch), load_adapter("g", GGUF, arch)
    assert ours.rank == peft.rank == 4 and ours.modules.keys() == peft.modules.keys()
    assert len(ours.modules) == 7 * arch.num_layers
    for module, want in peft.modules.items():
        got = ours.modules[module]
        assert torch.equal(got.a, want.a) and torch.equal(got.b, want.b), module
        assert got.scale == want.scale == 12 / 4, module


def test_the_gguf_adapter_gives_peft_tokens_in_a_mixed_batch(llama, peft_ref):
    """Base, peft-files and GGUF requests in one engine, joining one a step: the GGUF
    request's greedy tokens are transformers + peft's with the files it came from, each
    logprob within 1e-4, and the peft-files request's equal it."""
    lora = {"peft": str(PEFT), "gguf": str(GGUF)}
    model_dir, _ = llama
    h = Recorder(make_config(model_dir, lora_modules=lora, max_loras=2))
    requests = [("base", ""), ("peft", "peft"), ("gguf", "gguf")]
    h.run({k: [(rid, PROMPT, GREEDY, "", 0, None, a)] for k, (rid, a) in enumerate(requests)})
    got = h.outputs["gguf"]
    assert len(got) == GREEDY.max_tokens
    chosen, lps = scores(peft_ref, PROMPT, got)
    assert got == chosen
    torch.testing.assert_close(torch.tensor(h.logprobs["gguf"]), torch.tensor(lps), atol=1e-4,
                               rtol=0)  # fmt: skip
    assert h.outputs["peft"] == got and h.outputs["base"] != got


def _rewrite(src: Path, out: Path, arch: str = "llama", kind: str = "adapter", drop: int = 0,
             extra: dict[str, np.ndarray] | None = None) -> Path:  # fmt: skip
    """The fixture written again with another architecture or general.type, its first `drop`
    tensors left out and `extra` tensors added."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, arch)
    w.add_type(kind)
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 12.0)
    tensors = {t.name: np.array(t.data) for t in reader.tensors[drop:]}
    for name, data in {**tensors, **(extra or {})}.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_gguf_files_that_do_not_fit_are_refused_naming_file_and_cause(arch, tmp_path):
    zeros = np.zeros
    bad = {
        "not a LoRA adapter (general.type 'model'": _rewrite(GGUF, tmp_path / "m.gguf",
                                                             kind="model"),
        "for architecture 'qwen2', the model is 'llama'": _rewrite(GGUF, tmp_path / "q.gguf",
                                                                   arch="qwen2"),
        "blk.0.ffn_norm.weight.lora_a' is not on a projection": _rewrite(
            GGUF, tmp_path / "n.gguf", extra={"blk.0.ffn_norm.weight.lora_a": zeros((4, 64))}),
        "blk.9.attn_q.weight.lora_a' is not on a projection": _rewrite(
            GGUF, tmp_path / "l.gguf", extra={"blk.9.attn_q.weight.lora_a": zeros((4, 64))}),
        "token_embd.weight: adapters on the embeddings": _rewrite(
            GGUF, tmp_path / "e.gguf", extra={"token_embd.weight.lora_a": zeros((4, 64))}),
        "lora_a and lora_b must both be present": _rewrite(GGUF, tmp_path / "h.gguf", drop=1),
        "do not fit the layer's [64, 64]": _rewrite(GGUF, tmp_path / "s.gguf", extra={
            "blk.0.attn_q.weight.lora_b": zeros((48, 4), dtype=np.float32)}),
    }  # fmt: skip
    for words, path in bad.items():
        with pytest.raises(AdapterError, match=rf"^x: {path.name}: .*{re.escape(words)}"):
            load_adapter("x", path, arch)
    with pytest.raises(AdapterError, match=r"tiny-llama-lora.gguf: .*rank 4 is over "
                                           "--max-lora-rank 2"):  # fmt: skip
        load_adapter("x", GGUF, arch, max_rank=2)
    (tmp_path / "cut.gguf").write_bytes(GGUF.read_bytes()[:4000])
    with pytest.raises(AdapterError, match="cut.gguf"):
        load_adapter("x", tmp_path / "cut.gguf", arch)


def test_a_gguf_adapter_loads_at_run_time_and_a_bad_one_loads_nothing(llama, peft_ref, tmp_path):
    """POST /v1/load_lora_adapter's path through the core and the runner's reader: the GGUF
    file loads while its request waits, then gives peft's tokens; another architecture's
    GGUF is refused with its reason."""
    other = _rewrite(GGUF, tmp_path / "qwen.gguf", arch="qwen2")
    h = Recorder(make_config(llama[0], enable_lora=True, lora_dirs=(str(FIXTURES),),
                             max_loras=1))  # fmt: skip
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    loads = [LoadLora(0, 0, "g", str(GGUF)), LoadLora(0, 1, "q", str(other))]
    h.run({0: [("g", PROMPT, short, "", 0, None, "g")]}, messages={0: loads})
    answers = {a.token: a for a in h.frontend if isinstance(a, LoraAdapters) and a.token >= 0}
    assert answers[0].error == "" and answers[0].names == ["g"]
    assert answers[1].status == 400 and "architecture 'qwen2'" in answers[1].error
    got = h.outputs["g"]
    assert len(got) == short.max_tokens and got == scores(peft_ref, PROMPT, got)[0]


def test_lora_modules_take_a_gguf_file_held_to_the_model(llama, tiny_model_dir):
    """`gapless serve --lora-modules g=FILE.gguf` reads it at start; on a model whose MLP is
    wider than the one it was made for, the start stops naming the flag, file and cause."""
    from tests.launch.test_cli import serve_config

    config = serve_config("--model", str(llama[0]), "--lora-modules", f"g={GGUF}")
    assert config.enable_lora and config.lora_modules == {"g": str(GGUF)}
    with pytest.raises(ValueError, match=r"^--lora-modules g: g: tiny-llama-lora\.gguf: "
                                         r".*mlp.* do not fit the layer's"):  # fmt: skip
        serve_config("--model", str(tiny_model_dir), "--lora-modules", f"g={GGUF}")
