"""``python -m runtime.training.questions``: chat prompts that the target writes itself.

    python -m runtime.training.questions --out runs/prompts/self-chat.jsonl [--model M] [--batch-size 64] [--skip N] [--limit N]
        [--topics FILE]  (one topic per line; written by --write-topics FILE where the corpus packages are installed)
        [--like-chat [--seeds FILE...]]  (instead: messages in the style of chatterbot's training lines,
                                          or of the one-message prompts in FILE, such as an earlier --like-chat's)

Chat is where the package corpora teach a drafter least: chatterbot's lines are few, and
the held-out chat set is made of them. So the target is asked, greedily, to write what a
person might ask or tell a chatbot about a topic (topics: chatterbot's categories, the
words of gensim's analogy list and of its SimLex-999 pairs), and the question in each reply
becomes a user prompt. With ``--like-chat`` the target is shown one of chatterbot's training
lines at a time instead and asked for another in its style (held-out lines are never shown,
and a written line equal to any of chatterbot's is dropped). ``--seeds`` shows the target
the lines of an earlier run's output instead: each generation of lines in chatterbot's style
seeds a larger next one, since the corpus's own 1,834 training lines are few.
Its responses are then regenerated like every other prompt's (``python -m runtime.train
--data FILE``, or ``runtime.training.export --base OLD --data FILE`` to add them to a set).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tqdm import tqdm

from ..cli import add_model_arguments, new_parser, run_cli
from ..defaults import default_model_path
from ..loading import LoadedModel, load_target
from .corpora import (HELDOUT_FRACTION, analogy_lines, canonical, chat_prompts, chatterbot_files, file_prompts, heldout_lines,
                      is_heldout, sharing_no_heldout_line, simlex_words, user_prompt)
from .data import greedy_batch, length_sorted_batches, render_prompt

# what the target is asked to write, about each topic
ASKS = (
    "Write one short question that a person might ask a chatbot about {}. Reply with the question only.",
    "Write one short trivia question about {}. Reply with the question only.",
    "Write one thing a person might say to a friendly chatbot about {}. Reply with that sentence only.",
    "Write one question a curious child might ask about {}. Reply with the question only.",
    "Write one short, casual message that a person might type to a chatbot about {}. Reply with the message only.",
    "Write one short request that a person might send to an AI assistant about {}. Reply with the request only.",
    "Write one opinion question about {} that a person might ask a chatbot. Reply with the question only.",
    "Write one question a student might ask a teacher about {}. Reply with the question only.",
    "Write one 'why' question about {}. Reply with the question only.",
    "Write one thing a person might tell a chatbot about how they feel about {}. Reply with that sentence only.",
    "Write one question a person might ask a chatbot for advice about {}. Reply with the question only.",
    "Write one question a person might ask a chatbot about its own likes and dislikes, on {}. Reply with the question only.",
    # chatterbot's lines are often claims and remarks, not questions, and the replies to them essays
    "Write one bold claim about {} that a person might make to a chatbot. Reply with the claim only.",
    "Write one short statement about {} that a person might type to start a conversation. Reply with the statement only.",
    "Write one question that asks a chatbot to explain {} in detail. Reply with the question only.",
)
# what the target is asked to write after one of chatterbot's training lines: the held-out
# chat set is made of such lines, so prompts in their style teach the drafter its replies
LIKE_ASKS = (
    'A person said this to a chatbot: "{}" Write one different message a person might send a chatbot in the same style. '
    "Reply with the message only.",
    'Rephrase this message to a chatbot in other words: "{}" Reply with the new message only.',
    'A person told a chatbot: "{}" Write the next message the person might send. Reply with the message only.',
    'Write one question on the same subject as this message to a chatbot: "{}" Reply with the question only.',
    'Write one bold claim on the same subject as this message: "{}" Reply with the claim only.',
    'Write one trivia question on the same subject as this message: "{}" Reply with the question only.',
)
# chatterbot-corpus file stems, as a person would name them
CATEGORY_TOPICS = {"ai": "artificial intelligence", "botprofile": "the chatbot itself", "conversations": "everyday life",
                   "emotion": "feelings", "gossip": "gossip", "tech_support": "tech support"}
MAX_REPLY_TOKENS = 48
QUOTED = re.compile(r'"([^"\n]{8,200})"')
LEAD_IN = re.compile(r"^[\w ,']{0,40}(?:ask|say|question)[\w ]{0,12}:\s*", re.IGNORECASE)


def topics() -> list[str]:
    """chatterbot's categories, then each word of gensim's analogy list, then of its SimLex-999 pairs, once."""
    found = dict.fromkeys(CATEGORY_TOPICS.get(path.stem, path.stem.replace("_", " ")) for path in chatterbot_files())
    for _, words in analogy_lines():
        found.update(dict.fromkeys(words))
    found.update(dict.fromkeys(simlex_words()))
    return list(found)


def chat_lines() -> tuple[list[str], set[str], set[str]]:
    """chatterbot's single-line training prompts (none sharing a line with a held-out one), the
    canonical form (``canonical``) of every line it has, and of every line of its held-out prompts:
    a written prompt equal to a known line is dropped, so the held-out ones never enter training and
    the training ones are not added twice; a seed line equal to a held-out one is never shown."""
    prompts = chat_prompts()
    known = {canonical(content) for p in prompts for _, content in p.messages}
    heldout = heldout_lines(prompts)
    training = [p for p in sharing_no_heldout_line(prompts, heldout) if not is_heldout(p, HELDOUT_FRACTION)]
    lines = [p.messages[0][1] for p in training if len(p.messages) == 1]
    return [line for line in lines if len(canonical(line)) >= 2], known, heldout  # not the corpus's stray '"' or ','


def seed_lines(paths: list[Path], refused: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The user line of each one-message prompt in ``paths`` (as ``--like-chat`` writes them), once,
    but for lines whose ``canonical`` form is in ``refused``."""
    found = dict.fromkeys(p.messages[0][1] for path in paths for p in file_prompts(path) if len(p.messages) == 1)
    return [line for line in found if canonical(line) not in refused]


def extract_question(reply: str) -> str | None:
    """The question (or remark) in the target's reply: its first quoted sentence, else its first
    line without a lead-in such as "A person might ask:"; None for placeholders, fragments and
    sentences cut short."""
    quoted = QUOTED.search(reply)
    text = quoted.group(1) if quoted else LEAD_IN.sub("", next((l for l in reply.splitlines() if l.strip()), ""))
    text = text.strip().strip('"').strip()
    if not 8 <= len(text) <= 200 or "[" in text or "{" in text or text[-1] not in ".?!":
        return None  # too short or long, a placeholder, or cut off by the reply's token limit
    return text


def ask_prompts(topic_list: list[str] | None = None) -> list[str]:
    """Every ask about every topic (default: ``topics()``), topics in order."""
    return [ask.format(topic) for topic in (topic_list if topic_list is not None else topics()) for ask in ASKS]


def like_prompts(lines: list[str]) -> list[str]:
    """Every ask of ``LIKE_ASKS`` about every line, lines in order."""
    return [ask.format(line) for line in lines for ask in LIKE_ASKS]


def write_questions(target: LoadedModel, asks: list[str], out: Path, batch_size: int,
                    known: frozenset[str] = frozenset()) -> int:
    """Ask the target, extract the distinct questions, write them as chat prompts; returns how many.

    A question whose ``canonical`` form is in ``known`` is dropped. Each batch's new questions
    are written as they come, so a run cut short keeps its work.
    """
    ids = [render_prompt(user_prompt("self-chat", ask), target.tokenizer) for ask in asks]
    questions: dict[str, None] = {}
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as handle, tqdm(total=len(asks), desc="asking the target", unit="ask") as bar:
        for batch in length_sorted_batches([len(p) for p in ids], batch_size):
            for reply in greedy_batch(target.model, [ids[i] for i in batch], MAX_REPLY_TOKENS, target.tokenizer.eos_token_ids):
                question = extract_question(target.tokenizer.decode(reply, skip_special_tokens=True))
                if question is not None and question not in questions and canonical(question) not in known:
                    questions[question] = None
                    handle.write(json.dumps({"messages": [{"role": "user", "content": question}]}, ensure_ascii=False) + "\n")
            handle.flush()
            bar.update(len(batch))
            bar.set_postfix(questions=len(questions))
    return len(questions)


def main(argv: list[str] | None = None) -> None:
    parser = new_parser("python -m runtime.training.questions", __doc__)
    add_model_arguments(parser)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch-size", type=int, default=64, help="asks decoded together")
    parser.add_argument("--limit", type=int, help="only the first N asks")
    parser.add_argument("--skip", type=int, default=0, help="leave out the first N asks (another run asked them)")
    parser.add_argument("--topics", type=Path, help="topics, one per line (default: from the corpus packages)")
    parser.add_argument("--write-topics", type=Path, help="write the corpus packages' topics to this file and stop")
    parser.add_argument("--like-chat", action="store_true", help="instead of topics: messages in the style of "
                        "chatterbot's training lines (needs the corpus package; held-out lines never come out)")
    parser.add_argument("--seeds", type=Path, nargs="+", help="with --like-chat: show the target these files' "
                        "one-message prompts (an earlier --like-chat's output) instead of chatterbot's lines")
    args = parser.parse_args(argv)
    if args.seeds and not args.like_chat:
        parser.error("--seeds needs --like-chat")
    if args.write_topics:
        found = topics()
        args.write_topics.write_text("".join(f"{topic}\n" for topic in found), encoding="utf-8")
        print(f"{args.write_topics}: {len(found)} topics")
        return
    known: frozenset[str] = frozenset()
    if args.like_chat:
        lines, canonical_lines, heldout = chat_lines()
        if args.seeds:  # a seeds file from elsewhere may hold held-out lines: those are not shown
            lines = seed_lines(args.seeds, heldout)
            canonical_lines |= {canonical(line) for line in lines}  # a seed written again adds nothing
        asks, known = like_prompts(lines), frozenset(canonical_lines)
    else:
        topic_list = [t for t in args.topics.read_text(encoding="utf-8").splitlines() if t.strip()] if args.topics else None
        asks = ask_prompts(topic_list)
    asks = asks[args.skip:][: args.limit]
    target = load_target(args.model or default_model_path(), dtype=args.dtype)
    print(f"{args.out}: {write_questions(target, asks, args.out, args.batch_size, known)} prompts")


if __name__ == "__main__":
    run_cli(main)
