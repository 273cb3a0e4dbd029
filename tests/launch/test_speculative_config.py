"""`--speculative-config`: vLLM's JSON for the methods gapless has, and a clear error for the
rest (unknown keys and methods, vLLM's keys for what gapless lacks, bad values)."""

from __future__ import annotations

import pytest

from gapless.launch.speculative_config import parse_speculative_config
from tests.launch.test_cli import env, serve_config  # noqa: F401 (env: the autouse fixture)


def test_the_json_sets_the_method_and_k():
    config = serve_config(
        "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 6}'
    )
    assert (config.speculative, config.num_speculative_tokens) == ("suffix", 6)
    config = serve_config("--speculative-config", '{"method": "ngram"}')
    assert (config.speculative, config.num_speculative_tokens) == ("ngram", 4)
    # the JSON wins over the flags it stands for
    config = serve_config(
        "--speculative", "ngram", "--num-speculative-tokens", "2",
        "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 3}',
    )  # fmt: skip
    assert (config.speculative, config.num_speculative_tokens) == ("suffix", 3)
    assert serve_config().speculative == "off"


def test_vllms_draft_model_spelling_sets_the_method_and_the_model():
    text = '{"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 5}'
    assert parse_speculative_config(text) == {
        "speculative": "draft",
        "speculative_model": "/m/draft",
        "num_speculative_tokens": 5,
    }


@pytest.mark.parametrize(
    "text,error",
    [
        ("{", "not JSON"),
        ("[1]", "expected a JSON object"),
        ('{"num_speculative_tokens": 2}', "`method` is required: one of ngram, suffix, draft_"),
        ('{"method": "eagle3"}', "method 'eagle3' is not available (gapless has ngram, suffix"),
        ('{"method": "deepseek_mtp"}', "method 'deepseek_mtp' is not available"),
        ('{"method": "magic"}', "unknown method 'magic' (gapless has ngram, suffix, draft_"),
        ('{"method": 3}', "unknown method 3"),
        ('{"method": "draft_model", "quantization": "fp8"}', "takes the model's --dtype and --q"),
        ('{"method": "draft_model", "model": 3}', "`model` must be a path or Hub id (got 3)"),
        ('{"method": "ngram", "prompt_lookup_max": 5}', "n-gram lookup tries 3 tokens, then 2"),
        ('{"method": "ngram", "speed": 1}', "unknown key 'speed' (gapless takes method, model"),
        ('{"method": "ngram", "num_speculative_tokens": 17}', "an integer from 0 to 16 (got 17)"),
        ('{"method": "ngram", "num_speculative_tokens": "4"}', "an integer from 0 to 16"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "an integer from 0 to 16"),
    ],
)
def test_bad_configs_name_the_flag_and_what_is_wrong(text, error, capsys):
    with pytest.raises(SystemExit) as e:
        serve_config("--speculative-config", text)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --speculative-config: " in err and error in err, err
