"""Questions of other forms than the needle's, for the ``open_question`` task: what a person asks about a
document (what it is about, who wrote it, a name, a date, a count, a password for a key word). The needle tasks
only ever hide "The special magic number for KEY is NUMBER.", so none of these has its answer in a generated
context, and the right answer is ``NO_ANSWER``: what the embedded model should say to the questions it was
not built for, instead of a number."""

from __future__ import annotations

import random

DOCUMENTS = ("document", "report", "text", "paper", "article", "license", "manual", "book", "chapter", "section",
             "letter", "contract", "module", "guide", "study", "file", "page", "story", "note", "proposal")
ROLES = ("author", "licensor", "licensee", "publisher", "owner", "customer", "editor", "reviewer", "president",
         "manager", "sender", "narrator", "main character", "maintainer", "speaker")
THINGS = ("license", "company", "project", "author", "product", "city", "method", "module", "function", "team",
          "program", "country", "river", "school", "ship", "street", "library", "tool", "file", "museum")
PLURALS = ("pages", "examples", "people", "functions", "tables", "rules", "chapters", "figures", "steps",
           "countries", "names", "errors", "sections", "dates", "methods")
FIELDS = ("result", "date", "price", "conclusion", "goal", "topic", "title", "purpose", "argument", "deadline",
          "version", "cost", "risk", "finding", "recommendation")
ADJECTIVES = ("main", "first", "last", "final", "total", "most important", "central", "overall")
SECRETS = ("password", "secret code", "phone number", "address", "birthday", "colour", "favourite food",
           "serial number", "room number", "email address")

TEMPLATES = (
    "What does the {doc} conclude?",
    "What is the {doc} about?",
    "What is this {doc} about?",
    "Who wrote the {doc}?",
    "When was the {doc} written?",
    "What is the main point of the {doc}?",
    "Who is the {role}?",
    "Who is the {role} of the {doc}?",
    "What is the name of the {thing}?",
    "How many {plural} does the {doc} mention?",
    "What is the {adj} {field} of the {doc}?",
    "Where is the {thing} located?",
    "Which {plural} are listed in the {doc}?",
    "What is the {secret} for {key}?",
    "What is the {secret} of the {role}?",
    "Why does the {doc} mention the {thing}?",
    "What year is the {doc} from?",
    "what is the {field} of this {doc}",
    "Can you tell me the {field} in the {doc}?",
    "What did the {role} decide?",
)


def open_question(rng: random.Random, key: str) -> str:
    """One question drawn from ``TEMPLATES``; ``key`` fills the key-word slot (a needle key word asked with
    another attribute than its magic number)."""
    return rng.choice(TEMPLATES).format(
        doc=rng.choice(DOCUMENTS), role=rng.choice(ROLES), thing=rng.choice(THINGS), plural=rng.choice(PLURALS),
        field=rng.choice(FIELDS), adj=rng.choice(ADJECTIVES), secret=rng.choice(SECRETS), key=key)
