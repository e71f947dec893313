"""Seeded synthetic chat workloads built from a small vocabulary (no downloads)."""

from __future__ import annotations

import json
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


def shared_system_prompt(num_requests: int, seed: int, output_len: tuple[int, int] = (48, 112)) -> list[ChatRequest]:
    """Chat requests that open with one long system prompt and ask short questions: their prompts share their
    first KV blocks (prefix caching), the way an assistant's traffic does."""
    rng = random.Random(seed)
    system = " ".join(" ".join([rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(ENDINGS)])
                      for _ in range(12))
    system = f"You are a patient assistant. Answer briefly and plainly. Some background: {system}"
    requests = []
    for i in range(num_requests):
        question = rng.choice(QUESTIONS).format(topic=TOPICS[i % len(TOPICS)], other=rng.choice(TOPICS))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        requests.append(ChatRequest(messages, rng.randint(*output_len)))
    return requests


def random_prompts(
    num_requests: int,
    seed: int,
    vocab_size: int,
    input_len: int = 256,
    output_len: int = 128,
    range_ratio: float = 0.0,
    special_ids: frozenset[int] = frozenset(),
) -> list[tuple[list[int], int]]:
    """Prompts of random token ids and their max_tokens, lengths uniform in ``len x [1 - r, 1 + r]``."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio {range_ratio} must be in [0, 1)")
    rng = random.Random(seed)

    def length(center: int) -> int:
        return max(1, rng.randint(int(center * (1 - range_ratio)), int(center * (1 + range_ratio))))

    requests = []
    for _ in range(num_requests):
        ids: list[int] = []
        target = length(input_len)
        while len(ids) < target:
            token = rng.randrange(vocab_size)
            if token not in special_ids:
                ids.append(token)
        requests.append((ids, length(output_len)))
    return requests


def sharegpt(path: str, num_requests: int, seed: int) -> list[tuple[str, str]]:
    """(first human turn, first model reply) pairs from a ShareGPT JSON file, shuffled by ``seed``; entries that
    are not such a conversation are skipped.

    Raises:
        ValueError: the file is not a JSON list, or holds no conversation (naming the file and the format).
    """
    expected = 'expected a ShareGPT list: [{"conversations": [{"value": QUESTION}, {"value": ANSWER}, ...]}, ...]'
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e}); {expected}") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: the top level is not a list; {expected}")
    pairs = []
    for item in data:
        turns = (item.get("conversations") or item.get("conversation")) if isinstance(item, dict) else None
        if isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, dict) for t in turns[:2]) \
                and isinstance(turns[0].get("value"), str) and isinstance(turns[1].get("value"), str):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    if not pairs:
        raise ValueError(f"{path}: no conversations with a question and an answer; {expected}")
    random.Random(seed).shuffle(pairs)
    return pairs[:num_requests]
