#!/usr/bin/env python3
"""Retrieval tasks for the real-model evaluation (issue 16): passkey and
conversation recall, as JSON Lines (the format: docs/lm-eval.md).

Standard library only; the output depends on the flags and --seed alone
(every cell draws from its own random.Random seeded with a string, so a
--quick file is a subset of the full one for the same seed).

  bench/lm/make_tasks.py --out=tasks.jsonl                 # the full grid
  bench/lm/make_tasks.py --quick --seed=1 --out=quick.jsonl

One task per line:

  {"task": "passkey" | "conversation", "id": "passkey-L1024-d0.30-k07",
   "context": "...", "question": "...", "answer": "48213",
   "length": 1024, "depth": 0.3, "kind": "repeated" | "once"}

The model sees context + question exactly (no chat template); it should
continue with the answer. Scoring (kvkeep-lm answer, bench/lm/press_eval.py):
greedy decode up to 8 new tokens; exact match when the continuation,
stripped of leading spaces, starts with `answer`; and the log-probability
of the answer's tokens given context + question.

Lengths are in SmolLM2 tokens, approximate: the text is sized with the
token counts below, measured with the model's tokenizer (kvkeep-lm answer
reports each task's real count).
"""

import argparse
import json
import random
import sys

# --- passkey (Mohtashami & Jaggi 2023, as LongBench/InfiniteBench use it) ---

PASSKEY_PREAMBLE = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important "
    "information there.\n\n")
FILLER = ("The grass is green. The sky is blue. The sun is yellow. "
          "Here we go. There and back again. ")
PASSKEY_SENTENCE = "The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"

# SmolLM2 tokens (measured with the model's tokenizer): the preamble 30,
# each filler repetition 24 (its leading word takes the space before it),
# the key sentence with a 5-digit key 25.
PREAMBLE_TOKENS = 30
FILLER_TOKENS = 24
PASSKEY_TOKENS = 25


def passkey_context(length, depth, key):
    """The filler repeated to about `length` tokens, the key sentence after
    round(depth * repetitions) of them."""
    reps = max(1, round((length - PREAMBLE_TOKENS - PASSKEY_TOKENS) /
                        FILLER_TOKENS))
    before = round(depth * reps)
    return (PASSKEY_PREAMBLE + FILLER * before +
            PASSKEY_SENTENCE.format(key=key) + FILLER * (reps - before))


def passkey_tasks(lengths, depths, keys, seed):
    for length in lengths:
        for depth in depths:
            rng = random.Random(f"{seed}/passkey/{length}/{depth:.2f}")
            for k in range(keys):
                key = str(rng.randint(10000, 99999))
                yield {
                    "task": "passkey",
                    "id": f"passkey-L{length}-d{depth:.2f}-k{k:02d}",
                    "context": passkey_context(length, depth, key),
                    "question": PASSKEY_QUESTION,
                    "answer": key,
                    "length": length,
                    "depth": depth,
                }


# --- conversation recall -------------------------------------------------
#
# A plain-text chat between a user and an assistant. Early on (about 5% in)
# the user states a fact. The conversation then wanders through unrelated
# small talk and at the end the user asks for the fact.
#
#   kind "repeated": three times in between (at about 30, 55 and 80%) the
#     user refers to the fact by name and the assistant confirms it
#     remembers it -- without restating the value, so the value's only
#     copy is the early one, but later queries have attended to it (what
#     accumulated-attention policies such as H2O should keep).
#   kind "once": the same conversation, those three exchanges replaced by
#     small talk of similar length; the fact is asked about once, at the end.
#
# The two kinds of a pair (same length and k) share the fact, the value and
# every other turn.

FACTS = [
    # (how the user states it, how the user refers to it, the question's
    #  opening of the answer, the values)
    ("My locker code at the gym is {v}.", "my locker code",
     "What is my locker code?", "Your locker code is", "digits4"),
    ("The number of my hotel room is {v}.", "my hotel room number",
     "What is my hotel room number?", "Your hotel room number is", "digits3"),
    ("My cat's name is {v}.", "my cat's name",
     "What is my cat's name?", "Your cat's name is", "name"),
    ("My sister lives in a town called {v}.", "the town my sister lives in",
     "What is the town my sister lives in called?",
     "The town your sister lives in is called", "town"),
    ("The password for the office wifi is {v}.", "the office wifi password",
     "What is the office wifi password?", "The office wifi password is",
     "word"),
]
NAMES = ["Biscuit", "Pepper", "Marmalade", "Oscar", "Juniper", "Clementine",
         "Waffles", "Mochi", "Tiberius", "Noodle", "Saffron", "Bartholomew"]
TOWNS = ["Thornbury", "Millbrook", "Ashcombe", "Larkfield", "Dunmore",
         "Wexley", "Hollowell", "Stanwick", "Redmere", "Fenwick"]
WORDS = ["bluebird", "lanterns", "pinecone", "sailboat", "thunder",
         "marble", "hazelnut", "compass", "meadow", "starfish"]

ASK_BACK = [
    ("User: By the way, do you still remember {ref}?\n"
     "Assistant: Yes, I remember {ref}. I will keep it in mind.\n"),
    ("User: Quick check: you have not forgotten {ref}, have you?\n"
     "Assistant: No, I have not forgotten {ref}.\n"),
    ("User: I might need {ref} again later, so please hold on to it.\n"
     "Assistant: Of course, I still have {ref} and will keep it.\n"),
]

SMALL_TALK = [
    ("What is a good way to keep basil fresh?",
     "Trim the stems and keep the basil in a glass of water on the counter, "
     "loosely covered with a bag. The fridge tends to turn the leaves black."),
    ("Can you suggest a short book for a train ride?",
     "A novella works well: something you can finish in an afternoon, such "
     "as a collection of short stories or a classic adventure tale."),
    ("How long should I boil an egg for a soft yolk?",
     "About six minutes in gently boiling water, then straight into cold "
     "water so the yolk stays runny."),
    ("What should I pack for a weekend in the mountains?",
     "Layers, a rain jacket, good walking shoes, a water bottle, some snacks "
     "and a map, since the weather can change quickly up there."),
    ("Why do cats knead blankets?",
     "It is a habit from kittenhood, when kneading helped them feed. Adult "
     "cats often do it when they feel safe and relaxed."),
    ("Is it better to water plants in the morning or the evening?",
     "The morning is usually better: the water reaches the roots before the "
     "heat of the day, and the leaves dry before night."),
    ("Any tips for learning to juggle?",
     "Start with one ball, tossing it from hand to hand at eye level, then "
     "add a second and a third once the rhythm feels natural."),
    ("What is the difference between a lake and a pond?",
     "There is no strict rule, but lakes are usually larger and deeper, deep "
     "enough that sunlight does not reach the bottom everywhere."),
    ("How do I stop my glasses from fogging up?",
     "A drop of dish soap rubbed on the lenses and gently wiped off leaves a "
     "thin film that keeps fog from forming."),
    ("What is a simple dinner I can make in twenty minutes?",
     "Pasta with garlic, olive oil, chili and a handful of spinach is quick, "
     "cheap and needs only one pot and one pan."),
    ("Why is the sea salty?",
     "Rivers carry minerals from rocks into the sea, and when the water "
     "evaporates the salt stays behind, so it builds up over time."),
    ("How often should I replace my running shoes?",
     "Roughly every five to eight hundred kilometres, or sooner if the soles "
     "are worn or your knees start to complain."),
    ("What makes bread rise?",
     "Yeast feeds on the sugars in the dough and releases carbon dioxide, "
     "which the gluten traps in small bubbles."),
    ("Can you recommend a board game for four people?",
     "A cooperative game is a good choice for mixed groups, since everyone "
     "plays together against the board instead of against each other."),
    ("How do I get better sleep?",
     "Keep a regular schedule, avoid screens for an hour before bed, and keep "
     "the bedroom cool, dark and quiet."),
    ("What is the best way to remember names?",
     "Repeat the name when you are introduced, use it once in conversation, "
     "and link it to something memorable about the person."),
    ("Why do leaves change colour in autumn?",
     "As the days shorten, trees stop making chlorophyll, and the yellow and "
     "orange pigments that were hidden underneath show through."),
    ("How can I make my coffee less bitter?",
     "Use slightly cooler water, a coarser grind, or a shorter brewing time; "
     "a tiny pinch of salt also softens bitterness."),
    ("What should I look for when buying a bicycle?",
     "A frame that fits your height, gears that suit your hills, and brakes "
     "that feel firm. A test ride tells you more than any catalogue."),
    ("Is it true that goldfish have a three second memory?",
     "No, that is a myth. Goldfish can remember things for months and can "
     "even be trained to respond to sounds or colours."),
    ("How do I clean a cast iron pan?",
     "Rinse it with hot water and a brush, dry it on the stove, and rub in a "
     "thin layer of oil while it is still warm."),
    ("What is a nice day trip near the coast?",
     "A walk along the cliffs followed by lunch in a harbour town is hard to "
     "beat, especially early in the morning before the crowds."),
    ("How do birds know where to migrate?",
     "They use several cues together: the sun, the stars, the earth's "
     "magnetic field and landmarks they learned on earlier journeys."),
    ("What is a good stretch after sitting all day?",
     "Stand up, clasp your hands behind your back and gently lift them, which "
     "opens the chest and shoulders that hunch at a desk."),
]

REPEATED_AT = (0.30, 0.55, 0.80)
FACT_AT = 0.05
# SmolLM2 tokens per small-talk exchange, on average (measured: 42, 33 to 48).
TALK_TOKENS = 42
CONVERSATION_OPENING = ("The following is a conversation between a user and "
                        "a helpful assistant.\n\n")


def fact_value(kind, rng):
    if kind == "digits4":
        return str(rng.randint(1000, 9999))
    if kind == "digits3":
        return str(rng.randint(100, 999))
    if kind == "name":
        return rng.choice(NAMES)
    if kind == "town":
        return rng.choice(TOWNS)
    return rng.choice(WORDS)


def talk(rng, last):
    while True:
        i = rng.randrange(len(SMALL_TALK))
        if i != last:
            q, a = SMALL_TALK[i]
            return i, f"User: {q}\nAssistant: {a}\n"


def conversation_pair(length, k, seed):
    """The "repeated" and "once" tasks of one (length, k)."""
    rng = random.Random(f"{seed}/conversation/{length}/{k}")
    state, ref, question, lead, value_kind = FACTS[k % len(FACTS)]
    value = fact_value(value_kind, rng)
    turns = max(8, round(length / TALK_TOKENS))
    fact_turn = max(1, round(FACT_AT * turns))
    ask_turns = {max(fact_turn + 1, round(at * turns)) for at in REPEATED_AT}
    # Every turn drawn once, shared by both kinds.
    last = -1
    body = []  # (repeated text, once text)
    for t in range(turns):
        last, chat = talk(rng, last)
        if t == fact_turn:
            fact = (f"User: {state.format(v=value)} Please remember it.\n"
                    f"Assistant: Got it. {lead} {value}.\n")
            body.append((fact, fact))
        elif t in ask_turns:
            ask = rng.choice(ASK_BACK).format(ref=ref)
            body.append((ask, chat))
        else:
            body.append((chat, chat))
    q = f"User: {question}\nAssistant: {lead}"
    for kind, i in (("repeated", 0), ("once", 1)):
        yield {
            "task": "conversation",
            "id": f"conversation-L{length}-{kind}-k{k:02d}",
            "context": CONVERSATION_OPENING + "".join(b[i] for b in body),
            "question": q,
            "answer": value,
            "length": length,
            "depth": round(fact_turn / turns, 2),
            "kind": kind,
        }


def conversation_tasks(lengths, keys, seed):
    for length in lengths:
        for k in range(keys):
            yield from conversation_pair(length, k, seed)


def ints(text):
    return [int(x) for x in text.split(",") if x]


def floats(text):
    return [float(x) for x in text.split(",") if x]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="-", help="the .jsonl file (- : stdout)")
    p.add_argument("--seed", type=int, default=0, help="seed for keys/facts")
    p.add_argument("--quick", action="store_true",
                   help="a small grid (defaults below change)")
    p.add_argument("--tasks", default="passkey,conversation")
    p.add_argument("--lengths", default=None,
                   help="passkey context lengths in tokens "
                        "(full: 1024,2048,4096; quick: 1024,2048)")
    p.add_argument("--depths", default=None,
                   help="passkey depths (full: 0.1,0.2,...,0.9; "
                        "quick: 0.1,0.5,0.9)")
    p.add_argument("--keys", type=int, default=None,
                   help="passkey keys per (length, depth) (full 20, quick 3)")
    p.add_argument("--conv_lengths", default=None,
                   help="conversation lengths (full: 1024,2048,4096; "
                        "quick: 1024,2048)")
    p.add_argument("--conv_keys", type=int, default=None,
                   help="conversations per length and kind (full 20, "
                        "quick 5)")
    a = p.parse_args()
    q = a.quick
    lengths = ints(a.lengths or ("1024,2048" if q else "1024,2048,4096"))
    depths = floats(a.depths or ("0.1,0.5,0.9" if q else
                                 "0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9"))
    keys = a.keys if a.keys is not None else (3 if q else 20)
    conv_lengths = ints(a.conv_lengths or
                        ("1024,2048" if q else "1024,2048,4096"))
    conv_keys = a.conv_keys if a.conv_keys is not None else (5 if q else 20)
    wanted = set(a.tasks.split(","))
    unknown = wanted - {"passkey", "conversation"}
    if unknown:
        p.error(f"unknown task(s) {sorted(unknown)}")

    out = sys.stdout if a.out == "-" else open(a.out, "w", encoding="utf-8")
    n = 0
    if "passkey" in wanted:
        for t in passkey_tasks(lengths, depths, keys, a.seed):
            out.write(json.dumps(t) + "\n")
            n += 1
    if "conversation" in wanted:
        for t in conversation_tasks(conv_lengths, conv_keys, a.seed):
            out.write(json.dumps(t) + "\n")
            n += 1
    if out is not sys.stdout:
        out.close()
        print(f"{n} tasks -> {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
