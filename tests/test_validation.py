"""Every public generation function and command-line flag checks its input before any work: a wrong type is a
TypeError, a bad value a ValueError (a flag: argparse's error), each naming what is wrong."""
import math
import re

import pytest
import torch

import minispec as ms
from minispec.__main__ import main as demo_main
from minispec.bench import main as bench_main
from minispec.drafters import NGramDrafter
from minispec.speculative.sampling import MIN_TEMPERATURE
from minispec.speculative.stats import SpecStats
from minispec.ssm.hybrid import HybridLM
from tiny import tiny_gemma

PROMPT = torch.tensor([5, 6, 7, 5, 6, 7, 5, 6])
THREADS = str(torch.get_num_threads())  # the demo sets torch's threads; keep this process's


@pytest.fixture(scope="module")
def tiny():
    return tiny_gemma(layers=2)


@pytest.fixture(scope="module")
def bolt():
    return ms.load_target("bolt-mini")[0]


def ar(model, prompt=PROMPT, n=4, **kw):
    return ms.autoregressive_generate(model, prompt, n, **kw)


def spec(model, prompt=PROMPT, n=4, **kw):
    return ms.speculative_generate(model, NGramDrafter(model.config.vocab_size), prompt, n, **kw)


LOOPS = pytest.mark.parametrize("generate", [ar, spec], ids=["autoregressive", "speculative"])


# --- temperature ---------------------------------------------------------------------------------------------

@LOOPS
@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 1e-300])
def test_a_temperature_below_float32s_smallest_normal_is_refused(tiny, generate, temperature):
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or at least 1.1754944e-38"):
        generate(tiny, temperature=temperature)


@LOOPS
def test_the_smallest_temperature_samples_the_greedy_tokens(tiny, generate):
    """logits / T would overflow there; (logits - max) / T gives the T -> 0 limit, the argmax."""
    tiny_t = generate(tiny, n=8, temperature=MIN_TEMPERATURE, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tiny_t.tokens, generate(tiny, n=8).tokens)


@LOOPS
@pytest.mark.parametrize("kwargs, error, words", [
    ({"temperature": True}, TypeError, "temperature must be a number, got bool"),
    ({"temperature": "0.5"}, TypeError, "temperature must be a number, got str"),
    ({"temperature": 1.0, "top_k": True}, TypeError, "top_k must be an int >= 1 or None, got bool"),
    ({"temperature": 1.0, "top_k": 2.0}, TypeError, "top_k must be an int >= 1 or None, got float"),
    ({"temperature": 1.0, "top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
    ({"generator": 0}, TypeError, "generator must be a torch.Generator or None, got int"),
])
def test_sampling_arguments(tiny, generate, kwargs, error, words):
    with pytest.raises(error, match=words):
        generate(tiny, **kwargs)


# --- max_new_tokens and the model's positions ---------------------------------------------------------------

@LOOPS
@pytest.mark.parametrize("n, error, words", [
    (0, ValueError, "max_new_tokens must be a positive int, got 0"),
    (-3, ValueError, "max_new_tokens must be a positive int, got -3"),
    (True, TypeError, "max_new_tokens must be a positive int, got bool True"),
    (4.0, TypeError, "max_new_tokens must be a positive int, got float 4.0"),
    (None, TypeError, "max_new_tokens must be a positive int, got NoneType"),
])
def test_max_new_tokens(tiny, generate, n, error, words):
    with pytest.raises(error, match=words):
        generate(tiny, n=n)


@LOOPS
def test_prompt_and_new_tokens_must_fit_the_models_positions(bolt, generate):
    assert bolt.config.max_position_embeddings == 4096
    with pytest.raises(ValueError, match=r"prompt of 8 tokens \+ max_new_tokens 1000000000 = 1000000008 positions, "
                                         r"but the model has 4096 \(config.max_position_embeddings\)"):
        generate(bolt, n=10**9)
    with pytest.raises(ValueError, match=r"prompt of 5000 tokens \+ max_new_tokens 2 = 5002 positions, but the "
                                         "model has 4096"):
        generate(bolt, torch.full((5000,), 5), n=2)
    assert generate(bolt, torch.full((4094,), 5), n=2).tokens.shape == (1, 2)  # exactly 4096 fits


def test_a_hybrid_lm_checks_its_arguments_and_positions():
    model = HybridLM.from_pretrained("lightning-mini")
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int, got 0"):
        ms.autoregressive_generate(model, PROMPT, 0)
    with pytest.raises(ValueError, match=f"but the model has {model.config.max_position_embeddings}"):
        ms.autoregressive_generate(model, PROMPT, model.config.max_position_embeddings)


# --- prompts -------------------------------------------------------------------------------------------------

def test_a_flat_list_of_ids_is_one_prompt(tiny):
    assert torch.equal(ar(tiny, [5, 6, 7], 5).tokens, ar(tiny, torch.tensor([[5, 6, 7]]), 5).tokens)
    assert spec(tiny, [5, 6, 7], 5).tokens.shape[0] == 1


@LOOPS
@pytest.mark.parametrize("prompt, error, words", [
    ([], ValueError, "empty batch"),
    ([[5, 6], []], ValueError, "empty prompt at batch index 1"),
    (torch.zeros(2, 0, dtype=torch.long), ValueError, "empty prompt at batch index 0"),
    ([torch.tensor([[5, 6, 7]])], ValueError, r"prompt 0 must be 1-D token ids \[T\], got shape \(1, 3\)"),
    (torch.zeros(1, 2, 3, dtype=torch.long), ValueError, r"input_ids must be \[batch, T\] or one prompt"),
    ("def f(x):", TypeError, "got text 'def f\\(x\\):': tokenize it first"),
    ({"input_ids": [5, 6]}, TypeError, "got a mapping .* pass its \\['input_ids'\\]"),
    ([5.0, 6.0], TypeError, "prompt 0 holds float 5.0; token ids must be ints"),
    ([[5, True]], TypeError, "prompt 0 holds bool True; token ids must be ints"),
    ([5, [6]], TypeError, "prompt 0 must be a 1-D tensor or a list of token ids, got int"),
    (["def", "f"], TypeError, "prompt 0 holds str 'def'; token ids must be ints: tokenize the text first"),
    (torch.tensor([5.0, 6.0]), TypeError, "prompt 0 has dtype torch.float32; token ids must be integers"),
    (7, TypeError, "input_ids must be a tensor or a list of prompts, got int"),
    ([[5, 2**70]], ValueError, "prompt 0 holds a token id outside int64"),
    ([[5, 4096]], ValueError, r"token ids must lie in \[0, 4096\)"),
    ([[-1, 5]], ValueError, r"token ids must lie in \[0, 4096\)"),
])
def test_bad_prompts_name_the_problem(tiny, generate, prompt, error, words):
    with pytest.raises(error, match=words):
        generate(tiny, prompt)


# --- the target and the drafter --------------------------------------------------------------------------------

def test_a_name_is_not_a_model(tiny):
    with pytest.raises(TypeError, match=r"the target must be a causal LM .* got str: load it first, model, "
                                        r"tokenizer = ms.load_target\('bolt-mini'\)"):
        ms.autoregressive_generate("bolt-mini", PROMPT, 4)
    with pytest.raises(TypeError, match=r"the drafter must implement minispec.speculative.drafter.Drafter .* got str: "
                                        r"load it first, ms.load_drafter\('ngram', target\)"):
        ms.speculative_generate(tiny, "ngram", PROMPT, 4)
    with pytest.raises(TypeError, match="the target must be a causal LM"):
        ms.load_drafter("ngram", None)


@pytest.mark.parametrize("k, error", [(0, ValueError), (-2, ValueError), (True, TypeError), (2.5, TypeError)])
def test_the_number_of_draft_tokens(tiny, k, error):
    with pytest.raises(error, match="the number of draft tokens K must be an int >= 1"):
        ms.speculative_generate(tiny, NGramDrafter(4096), PROMPT, 4, num_draft_tokens=k)
    with pytest.raises(error, match="the number of draft tokens K must be an int >= 1"):
        ms.load_drafter("ngram", tiny, num_draft_tokens=k)


def test_on_cycle_must_be_callable(tiny):
    with pytest.raises(TypeError, match="on_cycle must be a function of one CycleRecord, or None, got list"):
        spec(tiny, on_cycle=[])


@pytest.mark.parametrize("load", [ms.load_target, lambda name: ms.load_drafter(name, tiny_gemma(layers=1))],
                         ids=["target", "drafter"])
def test_load_needs_a_name_or_a_folder(load):
    with pytest.raises(TypeError, match=r"must be a name or a folder \(str or Path\), got NoneType"):
        load(None)
    with pytest.raises(TypeError, match=r"must be a name or a folder \(str or Path\), got int"):
        load(3)


def test_load_target_dtype_must_be_a_float_dtype():
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
        ms.load_target("bolt-mini", dtype=torch.int64)


def test_a_folder_without_a_tokenizer_says_so(tmp_path):
    tiny_gemma(layers=1).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path)) + " has no tokenizer files .* tokenizer.save"):
        ms.load_target(tmp_path)


# --- randomness at T = 0, and tau without a verification -------------------------------------------------------

@LOOPS
def test_greedy_decoding_draws_no_random_numbers(tiny, generate):
    generator = torch.Generator().manual_seed(0)
    before, global_before = generator.get_state(), torch.get_rng_state()
    generate(tiny, n=12, generator=generator)
    generate(tiny, n=12)
    assert torch.equal(generator.get_state(), before)
    assert torch.equal(torch.get_rng_state(), global_before)


def test_tau_of_a_run_without_verification_is_one(tiny):
    """The first token, from the prefill, ends the run (EOS, or max_new_tokens = 1): τ is 1.0, never NaN."""
    first = int(ar(tiny, n=1).tokens[0, 0])
    one = spec(tiny, n=1)
    assert one.stats.verifications == [] and one.stats.tau == 1.0
    tiny.generation_config.eos_token_id = first
    try:
        ended = spec(tiny, n=8, temperature=1.0, generator=torch.Generator().manual_seed(0))
        greedy_ended = spec(tiny, n=8)
    finally:
        tiny.generation_config.eos_token_id = 1
    assert greedy_ended.tokens[0].tolist() == [first] and greedy_ended.stats.tau == 1.0
    assert math.isfinite(ended.stats.tau)  # whatever was sampled
    longer = spec(tiny, n=12)
    merged = SpecStats(one.stats.cycles + greedy_ended.stats.cycles + longer.stats.cycles)
    assert merged.tau == longer.stats.tau  # runs without verifications add nothing to an average


# --- the command lines -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["spec", "--prompts", "0"], "argument --prompts: must be an integer >= 1, got 0"),
    (["spec", "--repeats", "0"], "argument --repeats: must be an integer >= 1, got 0"),
    (["dflash", "--eval-prompts", "0"], "argument --eval-prompts: must be an integer >= 1, got 0"),
    (["ar", "--batch", "1", "0"], "argument --batch: must be an integer >= 1, got 0"),
    (["ar", "--threads", "0"], "argument --threads: must be an integer >= 1, got 0"),
    (["spec", "--max-new-tokens", "-1"], "argument --max-new-tokens: must be an integer >= 1, got -1"),
    (["spec", "--temperature", "nan"], "argument --temperature: must be a finite number"),
    (["spec", "--temperature", "1e-45"], r"argument --temperature: temperature must be 0 \(greedy\) or at least"),
    (["dflash", "--temperatures", "0", "1e-40"], "argument --temperatures: temperature must be 0"),
    (["dflash", "--timing-temperatures", "-1"], "argument --timing-temperatures: must be a number >= 0"),
])
def test_bench_flags_are_checked_while_parsing(capsys, argv, words):
    with pytest.raises(SystemExit) as exit_:
        bench_main(argv)
    assert exit_.value.code == 2
    assert re.search(words, capsys.readouterr().err)


@pytest.mark.parametrize("argv, words", [
    (["--prompt", "-1"], "argument --question/--prompt: must be an integer >= 0, got -1"),
    (["--threads", "0"], "argument --threads: must be an integer >= 1, got 0"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1, got 0"),
    (["--temperature", "-1"], "argument --temperature: must be a number >= 0"),
    (["--temperature", "1e-45"], "argument --temperature: temperature must be 0 (greedy) or at least"),
])
def test_demo_flags_are_checked_while_parsing(capsys, argv, words):
    with pytest.raises(SystemExit) as exit_:
        demo_main(["demo", "--target", "bolt-mini", *argv])
    assert exit_.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--prompt", "999"], "python -m minispec demo: --prompt 999: the frozen eval set has 241 prompts, numbered "
                          "0..240"),
    (["--max-new-tokens", "5000"], "python -m minispec demo: prompt of"),
])
def test_demo_values_that_need_the_model_end_with_a_message(argv, words):
    with pytest.raises(SystemExit) as exit_:
        demo_main(["demo", "--target", "bolt-mini", "--threads", THREADS, *argv])
    assert str(exit_.value.code).startswith(words)
