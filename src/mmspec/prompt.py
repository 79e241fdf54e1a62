"""Multimodal prompts: text with ``<image>`` slots, the paper's templates, and slot checks.

This module owns the *text* side of a prompt: the IbED Appendix C templates (the embedded
world's prompts, one space between parts), filling them, the prompts of the real benchmarks
as llava-hf's LLaVA-1.5 chat template renders them (newlines after the image and the
instruction), counting image slots and checking them against the images given, and the
embedded world's video prompt (one ``<video>`` marker where a clip goes). It knows nothing
about models or tokenizers beyond the literal ``<image>`` and ``<video>`` markers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mmspec.errors import MMSpecError

IMAGE_MARKER = "<image>"
VIDEO_MARKER = "<video>"  # one clip (all its frames), as LLaVA-NeXT-Video's processor marks it

# Appendix C of the IbED paper, verbatim. [QUESTION] / [CAPTION] are filled per sample.
SINGLE_IMAGE_QA = (
    "USER: <image> For the following question, provide a detailed explanation of your "
    "reasoning leading to the answer. [QUESTION] ASSISTANT:"
)
SPOT_THE_DIFF = (
    "USER: Explain the disparities between the first and second image. <image> <image> "
    "Difference: ASSISTANT:"
)
IEDIT = (
    "USER: Please provide instructions for editing the source image to match the target "
    "image. Source Image: <image> Target Image: <image> Instruction: ASSISTANT:"
)
PORORO_SV = (
    "USER: Given the progression of the story with the first few images, can you write a "
    "fitting end considering the last image? <image> Caption #1: [CAPTION] <image> "
    "Caption #2: [CAPTION]. <image> Caption #3: [CAPTION] <image> Caption #4: [CAPTION] "
    "<image> Caption #5: ASSISTANT:"
)
VIST = (
    "USER: With the narratives paired with the initial images, how would you conclude the "
    "story using the last picture? <image> Caption #1: [CAPTION] <image> Caption #2: "
    "[CAPTION]. <image> Caption #3: [CAPTION] <image> Caption #4: [CAPTION] <image> "
    "Caption #5: ASSISTANT:"
)

# The world's video families (mmspec.world.VIDEO_FAMILIES) mirror SINGLE_IMAGE_QA: the clip's
# marker first, then the same instruction and the question. Not in TEMPLATES, which the eight
# image families own.
VIDEO_QA = SINGLE_IMAGE_QA.replace(IMAGE_MARKER, VIDEO_MARKER)

TEMPLATES: dict[str, str] = {
    "chartqa": SINGLE_IMAGE_QA,
    "textvqa": SINGLE_IMAGE_QA,
    "vqav2": SINGLE_IMAGE_QA,
    "hallusionbench": SINGLE_IMAGE_QA,
    "spot_the_diff": SPOT_THE_DIFF,
    "iedit": IEDIT,
    "pororosv": PORORO_SV,
    "vist": VIST,
}


# The real benchmarks, as the IbED authors' code builds them: one user turn of llava-hf's
# LLaVA-1.5 chat template, which writes "USER: ", then "<image>\n" for each image part, then
# each text part followed by " ", then the generation prompt "ASSISTANT:".
QA_INSTRUCTION = (
    "For the following question, provide a detailed explanation of your reasoning leading to the answer."
)


def llava_user_turn(text: str, n_images_first: int = 0) -> str:
    """One LLaVA-1.5 user turn and the generation prompt, as llava-hf's chat template renders
    a message of ``n_images_first`` image parts and one text part: ``USER: <image>\\n{text} ASSISTANT:``.
    ``text`` is kept as given (its own ``<image>`` markers included), never stripped."""
    return "USER: " + (IMAGE_MARKER + "\n") * n_images_first + text + " ASSISTANT:"


def single_image_qa_prompt(question: str) -> str:
    """A real single-image benchmark's prompt (ChartQA, TextVQA, VQAv2, HallusionBench):
    ``USER: <image>\\n{QA_INSTRUCTION}\\n{question} ASSISTANT:``. The embedded world keeps
    :data:`SINGLE_IMAGE_QA` (spaces), the prompts its shipped models were trained on."""
    return llava_user_turn(f"{QA_INSTRUCTION}\n{question}", n_images_first=1)


def llava_chat(questions: Sequence[str], answers: Sequence[str], n_images: int = 1) -> str:
    """A conversation as llava-hf's LLaVA-1.5 chat template renders it, up to the next answer: the
    first user turn carries the ``n_images`` images, each answer is followed by a space, and the
    generation prompt ends it: ``USER: <image>\\n{q1} ASSISTANT: {a1} USER: {q2} ASSISTANT:``.
    ``answers`` holds one answer fewer than ``questions`` (the turns already answered)."""
    if len(answers) != len(questions) - 1:
        raise PromptError(f"a chat of {len(questions)} question(s) is rendered after {len(questions) - 1} "
                          f"answer(s), got {len(answers)}")
    text = "USER: " + (IMAGE_MARKER + "\n") * n_images + questions[0] + " "
    for answer, question in zip(answers, questions[1:]):
        text += f"ASSISTANT: {answer} USER: {question} "
    return text + "ASSISTANT:"


def chat_messages(questions: Sequence[str], answers: Sequence[str], n_images: int = 1) -> list[dict]:
    """The same conversation as a chat template's ``messages`` (transformers' content-part form): the
    images first in the first user turn, then alternating user and assistant turns."""
    messages = []
    for i, question in enumerate(questions):
        parts = [{"type": "image"}] * n_images if i == 0 else []
        messages.append({"role": "user", "content": [*parts, {"type": "text", "text": question}]})
        if i < len(answers):
            messages.append({"role": "assistant", "content": [{"type": "text", "text": answers[i]}]})
    return messages


class PromptError(MMSpecError):
    """A prompt that cannot be run as given; the message names the problem and the fix."""


def fill_template(template: str, question: str | None = None, captions: Sequence[str] = ()) -> str:
    """Fill ``[QUESTION]`` once and each ``[CAPTION]`` in order."""
    text = template
    if "[QUESTION]" in text:
        if question is None:
            raise PromptError("this template has a [QUESTION] slot; pass question=...")
        text = text.replace("[QUESTION]", question.strip())
    n_slots = text.count("[CAPTION]")
    if n_slots != len(captions):
        raise PromptError(
            f"this template has {n_slots} [CAPTION] slots but {len(captions)} captions were "
            "given; pass one caption for each slot"
        )
    for cap in captions:
        text = text.replace("[CAPTION]", cap.strip(), 1)
    return text


def count_image_slots(text: str) -> int:
    return text.count(IMAGE_MARKER)


def check_image_count(text: str, n_images: int) -> None:
    """Raise a clear error when the images do not match the prompt's ``<image>`` slots."""
    n_slots = count_image_slots(text)
    if n_slots != n_images:
        raise PromptError(
            f"the prompt has {n_slots} {IMAGE_MARKER} slot(s) but {n_images} image(s) were "
            f"given; put one {IMAGE_MARKER} in the prompt for each image (in order), or pass "
            f"{n_slots} image(s)"
        )


@dataclass
class MultimodalPrompt:
    """A prompt's text (with ``<image>`` slots) and its images, in slot order."""

    text: str
    images: list = field(default_factory=list)  # list[PIL.Image.Image]

    def __post_init__(self) -> None:
        check_image_count(self.text, len(self.images))
