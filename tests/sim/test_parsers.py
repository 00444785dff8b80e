"""Model-native markup and SGLang 0.5.23's reasoning / tool-call parsers, on and off."""

from __future__ import annotations

import json

import pytest

from harness.sim import http_post, sse_events, start_sim
from pdctl.sim import model as mdl
from pdctl.sim import parsers

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 2},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "detailed": {"type": "boolean"},
    }, "required": ["city", "days", "unit"]}}}
OTHER = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris for 3 days?"}],
        "tools": [WEATHER, OTHER], "chat_template_kwargs": {"thinking": True}}


def check_schema(args: dict) -> None:
    assert isinstance(args["city"], str) and len(args["city"]) >= 2
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 7
    assert args["unit"] in ("celsius", "fahrenheit")


@pytest.fixture(scope="module")
def with_parsers():
    with start_sim(["--reasoning-parser", "deepseek-v3", "--tool-call-parser", "deepseekv32"]) as p:
        yield p


@pytest.fixture(scope="module")
def without_parsers():
    with start_sim([]) as p:
        yield p


def test_example_for_schema_satisfies_schema():
    rng = mdl._Rng("seed")
    for _ in range(20):
        check_schema(mdl.example_for_schema(WEATHER["function"]["parameters"], rng))
    nested = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "number"},
                                                      "minItems": 2}, "o": {"anyOf": [{"type": "null"}]}},
              "required": ["xs", "o"]}
    v = mdl.example_for_schema(nested, rng)
    assert len(v["xs"]) == 2 and all(isinstance(x, float) for x in v["xs"]) and v["o"] is None


@pytest.mark.parametrize("family,parser", [
    ("deepseek-v32", "deepseekv32"), ("deepseek-v32-exp", "deepseekv31"), ("deepseek-v4", "deepseekv4"),
    ("deepseek-v41", "deepseekv41"), ("deepseek-v31", "deepseekv31"), ("deepseek-v3", "deepseekv3"),
])
def test_markup_round_trips_through_its_parser(family, parser):
    g = mdl.generate("ab" * 32, family=family, chat=True, thinking=False, tools=[WEATHER])
    normal, calls = parsers.parse_tool_calls(parser, g.text, [WEATHER])
    assert normal == "" and len(calls) == 1 and calls[0][0] == "get_weather"
    check_schema(json.loads(calls[0][1]))
    for other in parsers.TOOL_PARSERS - {parser}:
        assert parsers.parse_tool_calls(other, g.text, [WEATHER]) == (g.text, [])


def test_v41_and_v3_markup_are_sglangs_formats():
    # deepseekv41_detector: the DSML tag names begin with a space; deepseekv3_detector: function<｜tool▁sep｜>NAME,
    # then the arguments in a ```json block
    v41 = mdl.generate("ef" * 32, family="deepseek-v41", chat=True, thinking=False, tools=[WEATHER]).text
    assert v41.startswith('<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="')
    assert v41.endswith("</｜DSML｜ invoke>\n</｜DSML｜ calls>")
    v3 = mdl.generate("ef" * 32, family="deepseek-v3", chat=True, thinking=False, tools=[WEATHER]).text
    assert v3.startswith("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{")
    assert v3.endswith("}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    # R1 reasons whatever the request says (its template opens <think>): deepseek-r1 takes it apart
    r1 = mdl.generate("ef" * 32, family="deepseek-r1", chat=True, thinking=False, tools=[WEATHER]).text
    reasoning, rest = parsers.split_reasoning("deepseek-r1", r1, parsers.reasoning_forced("deepseek-r1", None))
    assert reasoning and parsers.parse_tool_calls("deepseekv3", rest, [WEATHER])[1][0][0] == "get_weather"


def test_dsml_markup_is_sglang_v32_format():
    g = mdl.generate("cd" * 32, family="deepseek-v32", chat=True, thinking=True, tools=[WEATHER])
    text = g.text
    reasoning, rest = text.split("</think>")
    assert reasoning and "<think>" not in text  # the chat template put <think> in the prompt
    assert rest.startswith("<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">")
    assert '<｜DSML｜parameter name="days" string="false">' in rest
    assert rest.endswith("</｜DSML｜function_calls>")


def test_reasoning_parser_rules():
    text = "thinking here</think>answer"
    assert parsers.split_reasoning("deepseek-v3", text, forced=True) == ("thinking here", "answer")
    assert parsers.split_reasoning("deepseek-v3", text, forced=False) == (None, text)
    assert parsers.split_reasoning("deepseek-r1", "no tags", forced=True) == ("no tags", "")
    assert parsers.reasoning_forced("deepseek-v3", {"thinking": True}) is True
    assert parsers.reasoning_forced("deepseek-v3", None) is False
    assert parsers.reasoning_forced("deepseek-r1", None) is True
    assert parsers.split_reasoning("kimi", text, forced=True) == (None, text)


def test_chat_with_parsers_gives_reasoning_and_tool_calls(with_parsers):
    code, out = http_post(with_parsers.url + "/v1/chat/completions", CHAT)
    assert code == 200
    choice = out["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert msg["reasoning_content"] and "</think>" not in msg["reasoning_content"]
    assert msg["content"] is None  # serving_chat: ChatMessage(content=text if text else None)
    (tc,) = msg["tool_calls"]
    assert tc["type"] == "function" and tc["function"]["name"] == "get_weather"
    assert tc["id"].startswith("call_") and len(tc["id"]) == 29
    check_schema(json.loads(tc["function"]["arguments"]))


def test_thinking_off_means_no_reasoning(with_parsers):
    body = {**CHAT, "chat_template_kwargs": {"thinking": False}}
    msg = http_post(with_parsers.url + "/v1/chat/completions", body)[1]["choices"][0]["message"]
    assert msg["reasoning_content"] is None and msg["tool_calls"]


def test_tool_choice_none_answers_in_text(with_parsers):
    body = {**CHAT, "tool_choice": "none"}
    out = http_post(with_parsers.url + "/v1/chat/completions", body)[1]["choices"][0]
    assert out["finish_reason"] == "stop" and out["message"]["tool_calls"] is None
    assert out["message"]["content"] and "DSML" not in out["message"]["content"]


def test_separate_reasoning_false_keeps_markup(with_parsers):
    body = {**CHAT, "separate_reasoning": False, "tools": None}
    msg = http_post(with_parsers.url + "/v1/chat/completions", body)[1]["choices"][0]["message"]
    assert msg["reasoning_content"] is None and "</think>" in msg["content"]


def test_without_parsers_raw_markup_stays_in_content(without_parsers):
    out = http_post(without_parsers.url + "/v1/chat/completions", CHAT)[1]["choices"][0]
    msg = out["message"]
    assert msg["reasoning_content"] is None and msg["tool_calls"] is None
    assert "</think>" in msg["content"] and "<｜DSML｜function_calls>" in msg["content"]
    assert out["finish_reason"] == "stop"


def test_non_matching_parsers_leave_markup():
    with start_sim(["--reasoning-parser", "kimi", "--tool-call-parser", "deepseekv31"]) as p:
        msg = http_post(p.url + "/v1/chat/completions", CHAT)[1]["choices"][0]["message"]
        assert msg["reasoning_content"] is None and msg["tool_calls"] is None
        assert "<｜DSML｜function_calls>" in msg["content"]


def test_deepseek_v4_family_with_v4_parsers():
    with start_sim(["--reasoning-parser", "deepseek-v4", "--tool-call-parser", "deepseekv4"],
                   {"PDCTL_SIM_MODEL_FAMILY": "deepseek-v4"}) as p:
        msg = http_post(p.url + "/v1/chat/completions", CHAT)[1]["choices"][0]["message"]
        assert msg["reasoning_content"] and msg["tool_calls"][0]["function"]["name"] == "get_weather"
    with start_sim(["--tool-call-parser", "deepseekv32"], {"PDCTL_SIM_MODEL_FAMILY": "deepseek-v4"}) as p:
        msg = http_post(p.url + "/v1/chat/completions", CHAT)[1]["choices"][0]["message"]
        assert msg["tool_calls"] is None and "<｜DSML｜tool_calls>" in msg["content"]


def test_streaming_reasoning_and_tool_calls(with_parsers):
    import urllib.request
    req = urllib.request.Request(with_parsers.url + "/v1/chat/completions",
                                 data=json.dumps({**CHAT, "stream": True}).encode(),
                                 headers={"content-type": "application/json"})
    events = list(sse_events(urllib.request.urlopen(req, timeout=10).read()))
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    full = http_post(with_parsers.url + "/v1/chat/completions", CHAT)[1]["choices"][0]["message"]
    assert reasoning == full["reasoning_content"]
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == json.loads(
        full["tool_calls"][0]["function"]["arguments"])
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_bad_family_env_refuses_to_start():
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "pdctl.sim", "--model-path", "m"], capture_output=True,
                          text=True, timeout=20, env={"PDCTL_SIM_MODEL_FAMILY": "llama", "PATH": "/usr/bin"})
    assert proc.returncode != 0 and "PDCTL_SIM_MODEL_FAMILY" in proc.stderr


@pytest.mark.parametrize("path,family", [
    ("deepseek-ai/DeepSeek-V3.2", "deepseek-v32"), ("deepseek-ai/DeepSeek-V3.2-Exp", "deepseek-v32-exp"),
    ("deepseek-ai/DeepSeek-V4-Flash", "deepseek-v4"), ("deepseek-ai/DeepSeek-V4.1-Flash", "deepseek-v41"),
    ("deepseek-ai/DeepSeek-V3.1-Terminus", "deepseek-v31"), ("deepseek-ai/DeepSeek-R1-0528", "deepseek-r1"),
    ("deepseek-ai/DeepSeek-V3-0324", "deepseek-v3"), ("/models/some-model", "deepseek-v32"),
])
def test_family_follows_the_model(path, family, monkeypatch):
    monkeypatch.delenv("PDCTL_SIM_MODEL_FAMILY", raising=False)
    assert mdl.model_family(path) == family
    monkeypatch.setenv("PDCTL_SIM_MODEL_FAMILY", "deepseek-v31")
    assert mdl.model_family(path) == "deepseek-v31"


def test_family_from_local_config_json(tmp_path, monkeypatch):
    monkeypatch.delenv("PDCTL_SIM_MODEL_FAMILY", raising=False)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    assert mdl.model_family(str(tmp_path)) == "deepseek-v4"
    # the architecture comes from config.json; within it, the checkpoint's name picks the markup
    r1 = tmp_path / "DeepSeek-R1-0528"
    r1.mkdir()
    (r1 / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    assert mdl.model_family(str(r1)) == "deepseek-r1"
    (r1 / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))  # a name of another architecture
    assert mdl.model_family(str(r1)) == "deepseek-v4"


def test_v32_exp_is_a_dsa_model_with_v31_tool_calls():
    from pdctl.sim.server import Sim

    sim = Sim(["--model-path", "deepseek-ai/DeepSeek-V3.2-Exp"])
    assert sim.page_size == 64 and sim.resolved["kv_cache_dtype"] == "bfloat16"  # the DSA overrides
    assert sim.model_info()["architectures"] == ["DeepseekV32ForCausalLM"]


def test_v4_model_path_with_v4_parsers_parses():
    with start_sim(["--model-path", "deepseek-ai/DeepSeek-V4-Flash", "--reasoning-parser", "deepseek-v4",
                    "--tool-call-parser", "deepseekv4"]) as p:
        msg = http_post(p.url + "/v1/chat/completions", {**CHAT, "model": "x"})[1]["choices"][0]["message"]
        assert msg["reasoning_content"] and msg["tool_calls"][0]["function"]["name"] == "get_weather"


def test_v4_runs_on_dsv4_attention_in_256_token_pages_whatever_page_size_says():
    # SGLang 0.5.23 model_overrides/deepseek_v4.py declares attention_backend "dsv4" and page_size 256 for
    # DeepseekV4ForCausalLM, and a declaration wins over the command line (model_override_base.ResolvingConfig)
    from pdctl.sim.server import Sim

    for argv in ([], ["--page-size", "64"]):
        sim = Sim(["--model-path", "deepseek-ai/DeepSeek-V4-Flash", *argv])
        assert sim.page_size == 256 and sim.resolved["attention_backend"] == "dsv4"
        assert "Use dsv4 attention backend for DeepseekV4ForCausalLM, setting page_size to 256." in sim._startup_info
    sim = Sim(["--model-path", "deepseek-ai/DeepSeek-V3.2", "--page-size", "64"])
    assert sim.page_size == 64 and sim.resolved["attention_backend"] is None


def test_v4_kv_cache_dtype_is_fp8_unless_bfloat16_and_nothing_else_starts():
    # SGLang 0.5.23 overrides._deepseek_v4_kv_cache_dtype: auto -> fp8_e4m3; assert fp8_e4m3 or bfloat16
    import pytest

    from pdctl.sim.server import Sim, StartupError

    assert Sim(["--model-path", "deepseek-ai/DeepSeek-V4-Flash"]).resolved["kv_cache_dtype"] == "fp8_e4m3"
    assert Sim(["--model-path", "deepseek-ai/DeepSeek-V4-Flash", "--kv-cache-dtype", "bfloat16"]) \
        .resolved["kv_cache_dtype"] == "bfloat16"
    with pytest.raises(StartupError, match="bf16 is not supported for DeepseekV4ForCausalLM"):
        Sim(["--model-path", "deepseek-ai/DeepSeek-V4-Flash", "--kv-cache-dtype", "bf16"])


def test_a_model_override_that_is_not_json_stops_the_server_at_its_start():
    # SGLang takes --json-model-override-args as a string and json.loads it in ModelConfig.from_server_args
    import pytest

    from pdctl.sim.server import Sim, StartupError

    Sim(["--model-path", "deepseek-ai/DeepSeek-V3.2", "--json-model-override-args", '{"max_position_embeddings": 8}'])
    with pytest.raises(StartupError, match="JSONDecodeError: Expecting property name"):
        Sim(["--model-path", "deepseek-ai/DeepSeek-V3.2", "--json-model-override-args", "{bad"])
