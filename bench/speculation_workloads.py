"""The chat requests bench.speculation and bench.speculation_split send, and their flags for them.

- quote: "Repeat this text exactly: <a paragraph>", each paragraph its own (four sentences of a
  pool, starting one further along each time): the answer is in the prompt, which is what the
  ngram proposer (prompt lookup) looks in;
- templates: a few requests, each asked again with one detail changed (a name, a day, a city),
  interleaved: the answers to one template share most of their text, which the suffix proposer
  learns from the outputs it has seen, and which the request's own tokens do not hold.
"""

from __future__ import annotations

import argparse

SENTENCES = (
    "The river runs past the old mill and under the stone bridge before it reaches the sea.",
    "Every morning the baker opens his shop at six and sells bread to the people of the village.",
    "A small train crosses the valley twice a day, carrying letters, parcels and a few travellers.",
    "In winter the lake freezes over and the children skate on it until the sun goes down.",
    "The library on the hill keeps maps of the region that are more than two hundred years old.",
    "Farmers bring apples, cheese and honey to the market square every Saturday.",
    "At night the lighthouse turns its lamp slowly so that ships can find the harbour.",
    "The school has three classrooms, a garden and a bell that rings at nine o'clock.",
    "Visitors often climb the tower of the church to look at the fields and the forest.",
    "When it rains for many days, the road to the next town is closed by the flooded river.",
    "The museum shows the tools that the miners used when the valley still had a mine.",
    "Each summer the village holds a festival with music, dancing and a long table of food.",
    "The postman rides a red bicycle and knows the name of every dog on his route.",
    "An old oak tree stands in the middle of the square, and people meet beneath it to talk.",
    "The doctor visits the farms in the hills once a week in a small green car.",
    "Boats leave the harbour before dawn and come back in the afternoon with fish and crabs.",
    "The hotel by the station has twelve rooms and a restaurant that serves soup and fresh bread.",
    "In autumn the forest turns yellow and red, and the paths are covered with leaves.",
    "The clock on the town hall has been five minutes slow for as long as anyone remembers.",
)
SENTENCES_PER_PARAGRAPH = 4

TEMPLATES = (
    "Write a short, polite email to {0} saying that the weekly team meeting has moved from Monday to {1} at the same time.",
    "Describe the city of {0} in three sentences for a travel guide, mentioning {1}.",
    "Write a short product description for a {0} backpack with two pockets, a laptop sleeve and {1}.",
    "Give a numbered list of five tips for a new employee called {0} who starts on {1}.",
)
DETAILS = (
    (("Anna", "Tuesday"), ("Mark", "Wednesday"), ("Sofia", "Thursday"), ("James", "Friday")),
    (("Lisbon", "the river"), ("Vienna", "the music"), ("Kyoto", "the temples"), ("Oslo", "the harbour")),
    (("red", "a water bottle holder"), ("black", "a rain cover"), ("green", "padded straps"), ("blue", "a key clip")),
    (("Maria", "Monday"), ("Tom", "Tuesday"), ("Lena", "Wednesday"), ("Omar", "Thursday")),
)

Messages = list[dict[str, str]]


def _chat(text: str) -> Messages:
    return [{"role": "user", "content": text}]


def quote_requests(count: int) -> list[Messages]:
    """count distinct paragraphs to repeat."""
    requests = []
    for index in range(count):
        picked = [SENTENCES[(index + offset) % len(SENTENCES)] for offset in range(SENTENCES_PER_PARAGRAPH)]
        requests.append(_chat("Repeat this text exactly: " + " ".join(picked)))
    return requests


def template_requests(count: int) -> list[Messages]:
    """count requests: each template's first variant, then each one's second, and so on."""
    variants = max(len(details) for details in DETAILS)
    ordered = [
        _chat(template.format(*details[variant]))
        for variant in range(variants) for template, details in zip(TEMPLATES, DETAILS, strict=True)
    ]
    return [ordered[index % len(ordered)] for index in range(count)]


def add_workload_arguments(parser: argparse.ArgumentParser, default_model: str) -> None:
    """The flags both speculation benches take for the model and the quote workload's size."""
    parser.add_argument("--model", default=default_model)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")


WARM_UP = (_chat("Say hello."), _chat("What is two plus two?"))
