"""Seeded synthetic chat workloads built from a small vocabulary (no downloads)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TOPICS = [
    "the history of tea", "volcanoes", "how bread rises", "bicycle gears", "owls at night", "glassblowing",
    "ocean tides", "opening moves in chess", "copper mining", "old sea maps", "moss gardens", "lighthouses",
    "the printing press", "honeybees", "desert rain", "violin making", "northern lights", "clock towers",
    "river deltas", "paper airplanes", "coral reefs", "windmills", "the silk road", "snowflake shapes",
]
QUESTIONS = [
    "Explain {topic} to a curious student.",
    "Write a short story about {topic}.",
    "What are three surprising facts about {topic}?",
    "Summarize what is known about {topic}.",
    "Describe {topic} as if to someone who has never heard of it.",
    "Compare {topic} with {other}.",
]
SUBJECTS = ["A traveller", "The old engineer", "My neighbour", "A young scientist", "The village baker", "Our teacher"]
VERBS = ["noticed", "wrote about", "argued over", "carefully measured", "once described", "kept thinking about"]
OBJECTS = ["the morning light", "a strange pattern", "the smallest details", "an unexpected result", "the long winter"]
ENDINGS = ["before anyone else did.", "with great patience.", "in a notebook.", "for many years.", "late at night."]


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    max_tokens: int


def mixed(
    num_requests: int,
    seed: int,
    count_tokens: Callable[[list[dict[str, Any]]], int],
    input_len: tuple[int, int] = (30, 600),
    output_len: tuple[int, int] = (16, 256),
) -> list[ChatRequest]:
    """Chat requests with prompt lengths and output lengths drawn uniformly from the ranges.

    Args:
        count_tokens: prompt tokens of a conversation (the model's chat template applied).
        input_len: prompt length range in tokens (the template's own tokens included).
        output_len: ``max_tokens`` range.
    """
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        target = rng.randint(*input_len)
        topic, other = rng.sample(TOPICS, 2)
        question = rng.choice(QUESTIONS).format(topic=topic, other=other)
        background: list[str] = []
        messages = [{"role": "user", "content": question}]
        # Grow a background paragraph until the prompt reaches its target length.
        while count_tokens(messages) < target:
            background.append(" ".join([rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(ENDINGS)]))
            messages = [{"role": "user", "content": f"Background: {' '.join(background)}\n\n{question}"}]
        requests.append(ChatRequest(messages, rng.randint(*output_len)))
    return requests
