"""The multi-turn world family ``conversation``: determinism, splits, the turn-2 prompt, the vocabulary."""

from __future__ import annotations

import pytest

from mmspec.errors import MMSpecError
from mmspec.world import (
    FAMILIES,
    MULTI_TURN,
    generate_conversations,
    generate_samples,
    make_conversation,
)
from mmspec.world.conversation import BASE_FAMILIES
from mmspec.world.core import SPLITS


def _png(c):
    return [im.tobytes() for im in c.images]


def test_registered_apart_from_the_image_families():
    assert MULTI_TURN == {"conversation": 1}
    assert "conversation" not in FAMILIES  # the tokenizer corpus and shipped recipes stay as they were


def test_deterministic_and_index_dependent():
    a, b = make_conversation("val", 4, seed=3), make_conversation("val", 4, seed=3)
    assert (a.prompt1, a.question2, a.answer2, a.uid) == (b.prompt1, b.question2, b.answer2, b.uid)
    assert _png(a) == _png(b)
    c = make_conversation("val", 7, seed=3)
    assert (a.prompt1, a.question2) != (c.prompt1, c.question2)
    assert a.uid == "conversation-val-4"


def test_second_question_is_another_question_about_the_same_image():
    for c in generate_conversations("test", 12):
        assert c.base_family == BASE_FAMILIES[int(c.uid.rsplit("-", 1)[1]) % 3]
        assert c.question1 and c.question2 and c.question1 != c.question2
        assert len(c.images) == 1 and c.prompt1.count("<image>") == 1
        assert c.question1 in c.prompt1


def test_turn2_prompt_extends_turn1_with_the_answer_given():
    c = make_conversation("test", 0)
    p = c.turn2_prompt("The answer is cat 5.")
    assert p == f"{c.prompt1} The answer is cat 5. USER: {c.question2} ASSISTANT:"
    assert p.startswith(c.prompt1 + " ") and p.count("<image>") == 1
    assert c.turn2_prompt() == f"{c.prompt1} {c.answer1} USER: {c.question2} ASSISTANT:"  # reference answer
    assert c.turn2_prompt("  ") == f"{c.prompt1} USER: {c.question2} ASSISTANT:"  # an empty answer


def test_splits_are_disjoint_in_content():
    seen = {s: {(c.prompt1, c.question2, c.answer2) for c in generate_conversations(s, 20)} for s in SPLITS}
    assert not seen["train"] & seen["test"] and not seen["train"] & seen["val"] and not seen["val"] & seen["test"]


def test_no_question_of_a_test_conversation_is_a_train_sample_of_its_family():
    train = {f: {(s.prompt, tuple(s.captions)) for s in generate_samples(f, "train", 300)} for f in BASE_FAMILIES}
    for c in generate_conversations("test", 15):
        assert (c.prompt1, tuple(c.captions)) not in train[c.base_family]
        turn2 = c.prompt1.replace(c.question1, c.question2)  # turn 2's question, asked alone
        assert (turn2, tuple(c.captions)) not in train[c.base_family]


def test_text_is_in_the_world_vocabulary():
    from mmspec.world.tokenizer import train_tokenizer

    tok = train_tokenizer(vocab_size=2048, n_per_family=40)
    unk = tok.unk_token_id
    for c in generate_conversations("test", 6):
        ids = tok.encode(c.turn2_prompt(), add_special_tokens=False)
        assert unk not in ids
        # turn 2's tokens extend turn 1's prompt + answer (what a prefix cache keys on)
        head = tok.encode(f"{c.prompt1} {c.answer1}", add_special_tokens=False)
        assert ids[: len(head)] == head


def test_bad_split_and_index_are_clear_errors():
    with pytest.raises(MMSpecError, match="unknown split"):
        make_conversation("dev", 0)
    with pytest.raises(MMSpecError, match="index must be >= 0"):
        make_conversation("test", -1)
