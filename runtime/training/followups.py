"""Multi-turn training prompts: a regenerated chat, its reply, and a user's next message.

People talk to a chat model in turns, and the drafter then drafts with an earlier reply of
the target's in its context. Single-turn prompts never show it that. So after the first
regeneration, some finished chats are continued: the conversation so far (with the
target's own reply as the assistant turn, as a client would send it back), then a
follow-up from the user, and the target regenerates its next reply.

The follow-ups are of three kinds, as people write them: asks about the reply (shorter,
an example, why), details answering what an assistant often asks back, and a change of
subject (another training prompt's question). None is taken from the evaluation sets.
"""

from __future__ import annotations

from typing import Sequence

from ..tokenizer import Tokenizer
from .corpora import Prompt, content_hash
from .data import Example

ASKS_ABOUT_THE_REPLY = (
    "Can you explain that more simply?",
    "Thanks! Can you give me an example?",
    "Can you make it shorter?",
    "Why is that?",
    "What would be a good first step?",
    "Can you put that in a numbered list?",
    "What are the most common mistakes people make with this?",
    "How would you explain this to a ten-year-old?",
    "Could you write that as a short email I can send?",
    "What are the pros and cons?",
    "Can you sum that up in one sentence?",
    "Tell me more about the second point.",
    "Is there anything I should avoid?",
    "How long does that usually take?",
    "Could you give me three more ideas?",
    "What if I only have a few minutes a day?",
    "Can you show me how to do that in Python?",
    "Are you sure? Please check that again.",
    "What is the main takeaway?",
    "Thanks, that's really helpful!",
    "Can you say that in a more formal way?",
    "Could you add a short introduction?",
    "Which of those would you pick, and why?",
    "What does that word mean?",
    "Can you give me a step-by-step plan?",
    "How much would that cost, roughly?",
    "Can you write it as a table?",
    "I don't understand the last part.",
    "Can you make it sound friendlier?",
    "What should I read to learn more about this?",
)
DETAILS = (
    "I'm a complete beginner.",
    "I only have about an hour on weekends.",
    "It's for my two kids, aged six and nine.",
    "My budget is quite small.",
    "I live in a small city apartment.",
    "I have tried that already, and it didn't work.",
    "It's for a school project due on Friday.",
    "I'd like something I can do at home.",
    "I'm asking for my grandmother, who is 80.",
    "Mostly in the evenings after work.",
    "I need it to be simple and quick.",
    "We are a team of five people.",
)
SWITCHES = ("Different question: {other}", "{other}", "Thanks. Another thing: {other}", "OK. Now, {other}")


def follow_up(example: Example, others: Sequence[Prompt], seed: int) -> str:
    """The user's next message after ``example``, chosen by the example's hash (stable across runs)."""
    pick = content_hash(Prompt("follow-up", text=f"{seed}:{example.key}"), "follow-up")
    kind, index = pick % 4, pick // 4
    if kind == 3 and others:  # a change of subject, to another training chat's first question
        other = others[index % len(others)].messages[0][1]
        template = SWITCHES[(index // len(others)) % len(SWITCHES)]
        return template.format(other=other[:1].lower() + other[1:] if template.startswith("OK") else other)
    if kind == 2:
        return DETAILS[index % len(DETAILS)]
    return ASKS_ABOUT_THE_REPLY[index % len(ASKS_ABOUT_THE_REPLY)]


def follow_up_prompts(regenerated: Sequence[tuple[Prompt, Example]], tokenizer: Tokenizer,
                      count: int, seed: int) -> list[Prompt]:
    """Up to ``count`` three-turn chats continuing regenerated single-turn ones.

    Only training-split chats whose reply ended (a stop token, not the length cap) are
    continued: a cut reply is not what a person would answer.
    """
    stops = tokenizer.eos_token_ids
    chats = [(p, e) for p, e in regenerated if e.split == "train" and len(p.messages) == 1
             and e.response_ids and e.response_ids[-1] in stops]
    chats.sort(key=lambda pair: content_hash(Prompt("order", text=f"{seed}:{pair[1].key}"), "follow-up"))
    others = [p for p, _ in chats]
    made = []
    for prompt, example in chats[:count]:
        reply = tokenizer.decode(example.response_ids[:-1]).strip()
        messages = (*prompt.messages, ("assistant", reply), ("user", follow_up(example, others, seed)))
        made.append(Prompt(f"{prompt.source}+follow-up", messages=messages))
    return made
