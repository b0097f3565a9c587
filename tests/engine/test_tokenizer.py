"""Tokenizer loading, BOS handling, chat templates (against transformers' golden prompt), streaming
detokenization and stop strings."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from rawinfer.config import ModelConfig, ModelFormatError
from rawinfer.engine.stop import StopChecker, StopUpdate
from rawinfer.engine.tokenizer import (ChatTemplateError, IncrementalDetokenizer, NoTokenizerError, Tokenizer,
                                compile_chat_template)

from conftest import DATA as _DATA  # noqa: E402

DATA = Path(_DATA) / "tokenizer"
FFFD = "\ufffd"
SENTENCES = [
    "héllo wörld 日本語 🙂",
    "hello world, the quick brown fox jumps over the lazy dog",
    "日本語のテキストと絵文字 🙂🙃 が混ざる",
    "wörld héllo über naïve café, déjà vu",
    "the capital of France is Paris. The capital of Japan is Tokyo.",
]
UNK, BOS, EOS = 0, 1, 2


def make_config(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=256,
                bos_token_id=BOS, eos_token_ids=(EOS,), add_bos_token=False,
                chat_template=(DATA / "smollm2_chat_template.jinja").read_text(encoding="utf-8"))
    base.update(kw)
    return ModelConfig(**base)


def train_byte_level() -> HFTokenizer:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(SENTENCES, trainer)
    return hf


def train_sentencepiece_style() -> HFTokenizer:
    """Llama-2-like: '▁' word marks, <0xXX> byte fallback, decoder strips the first leading space."""
    hf = HFTokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    hf.train_from_iterator(SENTENCES, trainer)
    spec = json.loads(hf.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return HFTokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module")
def bl_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("byte_level")
    train_byte_level().save(str(d / "tokenizer.json"))
    return d


@pytest.fixture(scope="module")
def bl(bl_dir) -> Tokenizer:
    return Tokenizer.from_dir(str(bl_dir), make_config())


@pytest.fixture(scope="module")
def sp(tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp("sentencepiece")
    train_sentencepiece_style().save(str(d / "tokenizer.json"))
    return Tokenizer.from_dir(str(d), make_config(add_bos_token=True))


# ---- loading and encoding ---------------------------------------------------------------------------------

def test_roundtrip_and_properties(bl):
    for s in SENTENCES:
        ids = bl.encode(s)
        assert bl.decode(ids) == s
    assert bl.vocab_size == 360
    assert bl.eos_token_ids == (EOS,)
    assert bl.token_text(EOS) == "</s>"
    ids = bl.encode(SENTENCES[0])
    assert bl.decode(np.array(ids, dtype=np.int32)) == SENTENCES[0]     # sampled ids arrive as NumPy ints


def test_bos_prepended_once(bl_dir):
    tok = Tokenizer.from_dir(str(bl_dir), make_config(add_bos_token=True))
    plain = tok.encode("hello world", add_special_tokens=False)
    assert BOS not in plain
    assert tok.encode("hello world") == [BOS] + plain
    assert tok.encode("<s>hello world") == [BOS] + plain          # text already starts with BOS
    assert tok.encode("") == [BOS]
    no_bos = Tokenizer.from_dir(str(bl_dir), make_config(add_bos_token=False))
    assert no_bos.encode("hello world") == plain


def test_post_processor_bos_not_doubled(tmp_path):
    hf = train_byte_level()
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(str(tmp_path), make_config(add_bos_token=True))
    plain = tok.encode("hello", add_special_tokens=False)
    assert tok.encode("hello") == [BOS] + plain
    assert tok.encode("<s>hello") == [BOS] + plain                # post-processor BOS + text BOS -> one


def test_missing_tokenizer(tmp_path):
    with pytest.raises(NoTokenizerError, match="this model has no tokenizer; pass token ids"):
        Tokenizer.from_dir(str(tmp_path), make_config())
    assert issubclass(NoTokenizerError, ModelFormatError)


@pytest.mark.parametrize("content", ["{not json", '{"version": "1.0", "model": {"type": "Nope"}}', ""])
def test_corrupt_tokenizer(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(ModelFormatError, match=r"cannot read .*tokenizer\.json.*re-convert") as e:
        Tokenizer.from_dir(str(tmp_path), make_config())
    assert not isinstance(e.value, NoTokenizerError)


def test_encode_rejects_non_text(bl):
    with pytest.raises(ValueError, match="can only encode a string"):
        bl.encode([1, 2, 3])
    with pytest.raises(ValueError, match="not valid UTF-8"):            # b"ab\xffcd" read with surrogateescape
        bl.encode(b"ab\xffcd".decode("utf-8", "surrogateescape"))


# ---- chat templates ---------------------------------------------------------------------------------------

def test_smollm2_template_matches_transformers(bl):
    golden = json.loads((DATA / "smollm2_capital.json").read_text(encoding="utf-8"))
    text = bl.apply_chat_template(golden["messages"], add_generation_prompt=golden["add_generation_prompt"])
    assert text == golden["prompt_text"]
    # Without the generation prompt the assistant header is absent; with a system message none is added.
    assert bl.apply_chat_template(golden["messages"], add_generation_prompt=False) == \
        golden["prompt_text"][:-len("<|im_start|>assistant\n")]
    sys_first = [{"role": "system", "content": "Be brief."}, *golden["messages"]]
    assert bl.apply_chat_template(sys_first).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user")


LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "        {{- raise_exception('Unknown role: ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n")


def test_llama3_style_template(bl_dir):
    tok = Tokenizer.from_dir(str(bl_dir), make_config(chat_template=LLAMA3_TEMPLATE, add_bos_token=True))
    msgs = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "  Hi!  "}]
    expected = ("<s><|start_header_id|>system<|end_header_id|>\n\nBe kind.<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n")
    text = tok.apply_chat_template(msgs)
    assert text == expected
    assert tok.encode(text)[:2] == [BOS, tok.encode("<|", add_special_tokens=False)[0]]   # one BOS
    with pytest.raises(ChatTemplateError, match="Unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_template_environment_matches_transformers():
    # trim_blocks + lstrip_blocks: block tags leave no newline or indentation behind.
    t = compile_chat_template("{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n"
                              "    {% endif %}\n{% endfor %}\n")
    assert t.render(messages=[{"role": "user", "content": "a"}, {"role": "x", "content": "b"}]) == "[a]\n"
    # tojson: no HTML escaping, non-ASCII kept, indent supported.
    t = compile_chat_template("{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}")
    tools = [{"name": "wéather", "desc": "<b>&'"}]
    assert t.render(tools=tools) == json.dumps(tools, ensure_ascii=False) + "|" + \
        json.dumps(tools[0], ensure_ascii=False, indent=2)
    # loop controls, strftime_now, {% generation %}.
    t = compile_chat_template("{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
                              "{% generation %}G{% endgeneration %}{{ strftime_now('%Y') | length }}")
    assert t.render() == "01G4"


def test_template_variables(bl_dir):
    tpl = ("{{ bos_token }}|{{ eos_token }}|{{ pad_token is defined }}|{{ tools | length if tools else 'none' }}"
           "|{{ extra }}")
    tok = Tokenizer.from_dir(str(bl_dir), make_config(chat_template=tpl))
    assert tok.apply_chat_template([], extra="x") == "<s>|</s>|False|none|x"
    assert tok.apply_chat_template([], tools=[{"name": "f"}], extra=1) == "<s>|</s>|False|1|1"
    with pytest.raises(ValueError, match="tools must be a list"):
        tok.apply_chat_template([], tools={"name": "f"})


def test_template_sandboxed(bl_dir):
    tok = Tokenizer.from_dir(str(bl_dir), make_config(chat_template="{{ messages.append(1) }}"))
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([])


@pytest.mark.parametrize("messages, match", [
    ("hello", "must be a list"),
    ([("user", "hi")], r"messages\[0\] must be a dict"),
    ([{"content": "hi"}], r"messages\[0\] needs a non-empty string \"role\""),
    ([{"role": "user", "content": "ok"}, {"role": "user", "content": None}], r"messages\[1\] needs a string"),
    ([{"role": "user"}], r"needs a string \"content\""),
])
def test_bad_messages(bl, messages, match):
    with pytest.raises(ValueError, match=match):
        bl.apply_chat_template(messages)


def test_no_template_or_broken_template(bl_dir):
    tok = Tokenizer.from_dir(str(bl_dir), make_config(chat_template=None))
    with pytest.raises(ValueError, match="has no chat template.*--raw"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    tok = Tokenizer.from_dir(str(bl_dir), make_config(chat_template="{% for m in messages %}"))
    with pytest.raises(ChatTemplateError, match="not valid Jinja2.*--raw"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ---- incremental detokenization ---------------------------------------------------------------------------

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest map above U+0100."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def stream(tok: Tokenizer, ids: list[int], **kw) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kw)
    return [detok.add(i) for i in ids]


def check_stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True, strict: bool = True) -> None:
    """Streams ids and checks the deltas against whole decodes at every step.

    Always: where decode(ids so far) has no U+FFFD, the deltas so far equal it (so carry no U+FFFD).
    strict (byte-level BPE, whose decode is monotone): the deltas so far are always a prefix of
    decode(ids so far), equal to it whenever it does not end in U+FFFD, and the final text equals decode.
    NOTE: SentencePiece byte fallback is not monotone: its decoder turns a whole run of <0xXX> tokens
    into U+FFFDs while the run is not valid UTF-8 (even a run that a later byte completes), rewriting
    characters before the incomplete one.
    """
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    out = ""
    for n, i in enumerate(ids, 1):
        out += detok.add(i)
        full = tok.decode(ids[:n], skip_special_tokens=skip_special_tokens)
        if FFFD not in full:
            assert out == full, (ids[:n], out, full)
        if strict:
            assert full.startswith(out), (ids[:n], out, full)
            if not full.endswith(FFFD):
                assert out == full, (ids[:n], out, full)
    out += detok.finish()
    full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    if strict or FFFD not in full:
        assert out == full


def mixed_tokenization(tok: Tokenizer, text: str, byte_id: dict[int, int], rng: random.Random) -> list[int]:
    """Each character of text tokenized either normally or as its UTF-8 bytes, one byte token each."""
    ids: list[int] = []
    for ch in text:
        if rng.random() < 0.5:
            ids += [byte_id[b] for b in ch.encode("utf-8")]
        else:
            ids += tok.encode(ch, add_special_tokens=False)
    return ids


def test_multibyte_split_across_byte_tokens(bl):
    byte_id = {b: bl._hf.token_to_id(c) for b, c in bytes_to_unicode().items()}
    assert None not in byte_id.values()
    text = "日本語 🙂é"
    ids = [byte_id[b] for b in text.encode("utf-8")]
    deltas = stream(bl, ids)
    assert "".join(deltas) == text
    assert all(FFFD not in d for d in deltas)
    assert deltas[:3] == ["", "", "日"]                   # held back until the 3rd byte arrives
    assert [d for d in deltas if d] == list(text)         # each character exactly once, whole


PIECES = ["h", "é", "llo", " wörld", "日", "本語", "🙂", " ", "the", " Paris", "ö", "\n"]


def test_random_mixed_tokenizations(bl):
    """Texts with multi-byte characters split across byte tokens at random places."""
    rng = random.Random(0)
    byte_id = {b: bl._hf.token_to_id(c) for b, c in bytes_to_unicode().items()}
    for _ in range(150):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12)))
        ids = mixed_tokenization(bl, text, byte_id, rng)
        assert bl.decode(ids) == text
        check_stream(bl, ids)


def test_random_ids_byte_level(bl):
    rng = random.Random(1)
    for _ in range(150):
        ids = [rng.randrange(bl.vocab_size) for _ in range(rng.randint(1, 30))]
        check_stream(bl, ids, skip_special_tokens=rng.random() < 0.5)


def test_random_ids_sentencepiece(sp):
    rng = random.Random(2)
    for _ in range(150):
        ids = [rng.randrange(sp.vocab_size) for _ in range(rng.randint(1, 30))]
        check_stream(sp, ids, skip_special_tokens=rng.random() < 0.5, strict=False)


def test_random_mixed_tokenizations_sentencepiece(sp):
    rng = random.Random(4)
    byte_id = {b: sp._hf.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    for _ in range(150):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12)))
        ids = mixed_tokenization(sp, text, byte_id, rng)
        # Each character was encoded on its own, so its word mark may decode as one extra space.
        assert sp.decode(ids).replace(" ", "") == text.replace(" ", "")
        check_stream(sp, ids, strict=False)   # valid text: the final decode has no U+FFFD, so it must match


def test_sentencepiece_leading_space(sp):
    ids = sp.encode("hello world, the quick brown fox", add_special_tokens=False)
    assert sp.token_text(ids[1]) == "▁world,"
    assert [sp.decode([i]) for i in ids[:2]] == ["hello", "world,"]      # alone, '▁' decodes to nothing...
    deltas = stream(sp, ids)
    assert deltas[:2] == ["hello", " world,"]                              # ...but it is a space in the stream
    assert "".join(deltas) == "hello world, the quick brown fox"
    # Characters never seen in training go through <0xXX> byte tokens, one per UTF-8 byte.
    ids = sp.encode("wörld 漢 鳥 🚀!", add_special_tokens=False)
    assert sum(sp.token_text(i).startswith("<0x") for i in ids) == 3 + 3 + 4 + 1
    deltas = stream(sp, ids)
    assert "".join(deltas) == "wörld 漢 鳥 🚀!" and all(FFFD not in d for d in deltas)


def test_prompt_context_keeps_first_space(sp):
    prompt = sp.encode("the quick brown")
    out = sp.encode("the quick brown fox jumps", add_special_tokens=False)[len(prompt) - 1:]
    assert sp.decode(out).startswith("fox")                      # decoded alone: no space
    assert "".join(stream(sp, out, prompt_ids=prompt)) == " fox jumps"


def test_special_tokens(bl):
    ids = bl.encode("hello world", add_special_tokens=False) + [EOS]
    assert "".join(stream(bl, ids)) == "hello world"
    assert "".join(stream(bl, ids, skip_special_tokens=False)) == "hello world</s>"


def python_windows(tok: Tokenizer, ids: list[int], **kw) -> list[str]:
    """stream() through the detokenizer's own windows (as where tokenizers has no DecodeStream)."""
    detok = IncrementalDetokenizer(tok, **kw)
    detok._stream = None
    return [detok.add(i) for i in ids]


@pytest.mark.parametrize("name", ["bl", "sp"])
def test_decode_stream_and_python_windows_agree(name, request):
    """The Rust DecodeStream runs the same windows: the same deltas token by token, with and without prompt
    context, special tokens skipped or not, on random ids (incomplete characters included)."""
    tok = request.getfixturevalue(name)
    assert IncrementalDetokenizer(tok)._stream is not None      # the installed tokenizers has it
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        kw = {"skip_special_tokens": rng.random() < 0.5,
              "prompt_ids": [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 8))]}
        assert stream(tok, ids, **kw) == python_windows(tok, ids, **kw)


def test_a_refused_window_continues_in_python(bl):
    """Where DecodeStream raises (a window whose text does not extend the shown text), the sample goes on
    through its own windows from the same place: nothing is lost or repeated."""
    ids = bl.encode(" ".join(SENTENCES), add_special_tokens=False)

    class Refusing:
        def __init__(self, real, refuse_at):
            self.real, self.calls, self.refuse_at = real, 0, refuse_at

        def step(self, hf, token_id):
            self.calls += 1
            if self.calls == self.refuse_at:
                raise Exception("Invalid prefix encountered")
            return self.real.step(hf, token_id)

    for refuse_at in (1, 2, 7, len(ids)):
        detok = IncrementalDetokenizer(bl)
        detok._stream = Refusing(detok._stream, refuse_at)
        deltas = [detok.add(i) for i in ids]
        assert detok._stream is None
        assert deltas == python_windows(bl, ids)


def test_window_stays_small(bl):
    """Each step decodes a bounded window, not the whole output."""
    ids = bl.encode(" ".join(SENTENCES * 20), add_special_tokens=False)
    detok = IncrementalDetokenizer(bl)
    detok._stream = None
    widths = []
    real_decode = bl.decode

    class Spy:
        def decode(self, window, skip_special_tokens=False):
            widths.append(len(window))
            return real_decode(window, skip_special_tokens)

    detok._tok = Spy()
    text = "".join(detok.add(i) for i in ids)
    assert text == bl.decode(ids)
    assert len(ids) > 1000 and max(widths) <= 12   # bounded by the longest multi-token character


# ---- stop strings -----------------------------------------------------------------------------------------

def run_stop(stop: list[str], deltas: list[str]) -> tuple[list[StopUpdate], str]:
    checker = StopChecker(stop)
    updates = []
    for d in deltas:
        updates.append(checker.add(d))
        if updates[-1].stopped:
            break
    return updates, "" if checker.stopped else checker.flush()


def shown(updates: list[StopUpdate], tail: str = "") -> str:
    return "".join(u.text for u in updates) + tail


def test_stop_across_token_boundaries():
    updates, tail = run_stop(["STOP"], ["Hello S", "T", "O", "P and more"])
    assert [u.stopped for u in updates] == [False, False, False, True]
    assert [u.text for u in updates] == ["Hello ", "", "", ""]
    assert shown(updates, tail) == "Hello "


def test_stop_at_first_token():
    checker = StopChecker(["\n\n", "User:"])
    assert checker.add("User: hi") == StopUpdate("", True)
    assert checker.matched == "User:"
    assert checker.add("more") == StopUpdate("", True)       # stays stopped


def test_overlapping_candidates():
    # "abd" fails at 'd' but "bd" (which overlaps it) matches.
    updates, _ = run_stop(["abc", "bd"], ["x", "a", "b", "d", "tail"])
    assert shown(updates) == "xa" and updates[-1].stopped
    # A candidate's prefix repeats inside itself: "aab" in "aaab".
    updates, _ = run_stop(["aab"], ["a", "a", "a", "b"])
    assert shown(updates) == "a" and updates[-1].stopped


def test_multiple_stops_earliest_wins():
    checker = StopChecker(["world", "lo w"])
    update = checker.add("hello world")
    assert update == StopUpdate("hel", True) and checker.matched == "lo w"


def test_held_suffix_released():
    checker = StopChecker(["</answer>"])
    assert checker.add("x </ans") == StopUpdate("x ", False)
    assert checker.held == "</ans"
    assert checker.add("wer") == StopUpdate("", False)
    assert checker.add("s>") == StopUpdate("</answers>", False)    # not a stop after all: released
    assert checker.add(" end </") == StopUpdate(" end ", False)
    assert checker.flush() == "</"                                  # finish without a stop: flushed


def test_stop_property_random():
    """Against the definition: output = text before the first occurrence of any stop string."""
    rng = random.Random(3)
    stops_pool = ["ab", "ba", "abc", "cab", "bb", "c\n", "aaa"]
    for _ in range(500):
        stops = rng.sample(stops_pool, rng.randint(1, 3))
        text = "".join(rng.choice("abc\n") for _ in range(rng.randint(0, 20)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        checker = StopChecker(stops)
        out, stopped = "", False
        for d in deltas:
            u = checker.add(d)
            out += u.text
            # Never shows text the whole-text definition would cut.
            firsts = [p for s in stops if (p := text.find(s)) >= 0]
            assert len(out) <= (min(firsts) if firsts else len(text))
            if u.stopped:
                stopped = True
                break
        if not stopped:
            out += checker.flush()
        firsts = [p for s in stops if (p := text.find(s)) >= 0]
        if firsts:
            # Streaming stops at the first stop string to complete; the whole text may hold one
            # that starts earlier but completes later ("abc" vs "b..."), so check the weaker claim.
            assert stopped and text.startswith(out) and any(text[len(out):].startswith(s) for s in stops)
        else:
            assert not stopped and out == text


def test_no_stop_strings_pass_through():
    checker = StopChecker([])
    assert checker.add("anything") == StopUpdate("anything", False)
    assert checker.flush() == ""


def test_bad_stop_strings():
    with pytest.raises(ValueError, match="non-empty strings"):
        StopChecker(["ok", ""])


# ---- each token's own bytes ---------------------------------------------------------------------------------

def test_the_byte_level_alphabet_is_gpt2s():
    from rawinfer.engine.tokenizer import _BYTE_LEVEL
    assert _BYTE_LEVEL == {c: b for b, c in bytes_to_unicode().items()}
    assert set(_BYTE_LEVEL) == set(pre_tokenizers.ByteLevel.alphabet())


def test_token_bytes_join_into_the_text_byte_level(bl):
    """Characters split across byte tokens at random places: each token alone decodes to U+FFFD or part of
    the text, but their bytes join into exactly the text's UTF-8 (what OpenAI's logprobs `bytes` promise)."""
    rng = random.Random(3)
    byte_id = {b: bl._hf.token_to_id(c) for b, c in bytes_to_unicode().items()}
    partial = 0
    for _ in range(100):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12)))
        ids = mixed_tokenization(bl, text, byte_id, rng)
        assert b"".join(bl.token_bytes(i) for i in ids) == text.encode()
        partial += sum(FFFD in bl.decode([i]) for i in ids)
    assert partial > 100                              # the case that needs the vocabulary entries
    special = bl._hf.token_to_id("</s>")
    assert bl.token_bytes(special) == b"</s>"


def test_token_bytes_keep_sentencepiece_spaces_and_byte_fallback(sp):
    """Llama-2-style: '▁' marks a word's space (which decoding a token alone strips), <0xXX> one byte."""
    for text in ["hello there 日本語 🙂é", "the capital\nof France", " the sky"]:
        ids = sp.encode(text, add_special_tokens=False)
        assert b"".join(sp.token_bytes(i) for i in ids) == (text if text.startswith(" ") else " " + text).encode()
    assert sp.token_bytes(sp._hf.token_to_id("<0xE2>")) == b"\xe2"
    assert sp.token_bytes(sp._hf.token_to_id("<s>")) == b"<s>"


def test_render_chat_continues_the_final_message(bl, bl_dir):
    """continue_final_message (vLLM's): the text ends with the assistant message's content, the template's
    closing of it cut; without the generation prompt the chat ends closed. Options that do not fit the
    chat are one ChatTemplateError each."""
    from rawinfer.engine.tokenizer import render_chat
    chat = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "It is"}]
    closed = render_chat(bl, chat, add_generation_prompt=False)
    assert closed.endswith("<|im_start|>assistant\nIt is<|im_end|>\n")
    assert render_chat(bl, chat, add_generation_prompt=False, continue_final_message=True) == \
        closed[:-len("<|im_end|>\n")]
    assert render_chat(bl, chat).endswith("<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ChatTemplateError, match="add_generation_prompt to false"):
        render_chat(bl, chat, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="end with an assistant message"):
        render_chat(bl, chat[:1], add_generation_prompt=False, continue_final_message=True)
    hides = Tokenizer.from_dir(str(bl_dir), make_config(chat_template="{% for m in messages %}[{{ m.role }}]"
                                                                       "{% endfor %}"))
    with pytest.raises(ChatTemplateError, match="writes out as it is"):
        render_chat(hides, chat, add_generation_prompt=False, continue_final_message=True)


def test_render_chat_passes_template_kwargs(bl_dir):
    """chat_template_kwargs (vLLM's): more variables for the template, such as Qwen3's enable_thinking; the
    variables the server sets itself cannot be replaced."""
    from rawinfer.engine.tokenizer import render_chat
    tpl = ("{% for m in messages %}{{ m.content }}{% endfor %}"
           "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    tok = Tokenizer.from_dir(str(bl_dir), make_config(chat_template=tpl))
    chat = [{"role": "user", "content": "hi"}]
    assert render_chat(tok, chat) == "hi"
    assert render_chat(tok, chat, template_kwargs={"enable_thinking": False}) == "hi<think></think>"
    with pytest.raises(ChatTemplateError, match="'messages' is set by the server"):
        render_chat(tok, chat, template_kwargs={"messages": []})
