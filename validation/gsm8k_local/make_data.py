"""Write test.jsonl and train.jsonl: our own grade-school problems in GSM8K's format.

GSM8K itself cannot be fetched on the offline GPU machine; these are made
from templates with computed answers, so every answer is right by
construction. Deterministic: rerunning rewrites the same files.

    python validation/gsm8k_local/make_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Maria", "Tom", "Aisha", "Leo", "Nina", "Omar", "Grace", "Ivan", "Priya", "Sam"]
ITEMS = ["stickers", "marbles", "pencils", "cards", "beads", "stamps"]
TEST, TRAIN = 48, 8


def step(text: str, expr: str, value: int) -> str:
    """One reasoning line with GSM8K's calculator annotation."""
    return text.format(f"{expr} = <<{expr.replace(' ', '')}={value}>>{value}")


def packs(r: random.Random) -> tuple[str, list[str], int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    n, k = r.randint(3, 9), r.randint(6, 15)
    g = r.randint(2, n * k - 1)
    total = n * k
    return (
        f"{name} buys {n} packs of {item}. Each pack has {k} {item}. "
        f"{name} gives {g} {item} to a friend. How many {item} does {name} have left?",
        [
            step(f"{name} buys {{}} {item}.", f"{n} * {k}", total),
            step(
                f"After giving some away, {name} has {{}} {item} left.", f"{total} - {g}", total - g
            ),
        ],
        total - g,
    )


def babysitting(r: random.Random) -> tuple[str, list[str], int]:
    name, rate = r.choice(NAMES), r.randint(8, 20)
    h1, h2 = r.randint(2, 6), r.randint(2, 8)
    return (
        f"{name} earns ${rate} an hour babysitting. Last week {name} worked {h1} hours on "
        f"Monday and {h2} hours on Saturday. How much money did {name} earn last week?",
        [
            step(f"{name} worked {{}} hours.", f"{h1} + {h2}", h1 + h2),
            step(f"{name} earned {{}} dollars.", f"{h1 + h2} * {rate}", (h1 + h2) * rate),
        ],
        (h1 + h2) * rate,
    )


def book(r: random.Random) -> tuple[str, list[str], int]:
    name, a = r.choice(NAMES), r.randint(10, 40)
    total = 3 * a + r.randint(5, 120)
    return (
        f"{name} is reading a {total}-page book. Yesterday {name} read {a} pages. Today "
        f"{name} read twice as many pages as yesterday. How many pages are left to read?",
        [
            step("Today {} pages were read.", f"{a} * 2", 2 * a),
            step("So far {} pages were read.", f"{a} + {2 * a}", 3 * a),
            step("There are {} pages left.", f"{total} - {3 * a}", total - 3 * a),
        ],
        total - 3 * a,
    )


def apples(r: random.Random) -> tuple[str, list[str], int]:
    b, k = r.randint(4, 12), r.randint(10, 25)
    total = b * k
    s = r.randint(5, total // 2)
    u = r.randint(1, total - s - 1)
    return (
        f"A farmer has {b} baskets with {k} apples in each basket. He sells {s} apples at the "
        f"market and uses {u} apples to bake pies. How many apples does he have left?",
        [
            step("The farmer has {} apples.", f"{b} * {k}", total),
            step("He sells or uses {} apples.", f"{s} + {u}", s + u),
            step("He has {} apples left.", f"{total} - {s + u}", total - s - u),
        ],
        total - s - u,
    )


def notebooks(r: random.Random) -> tuple[str, list[str], int]:
    name, n, c, p = r.choice(NAMES), r.randint(2, 6), r.randint(2, 9), r.randint(1, 5)
    m = n * c + p + r.randint(1, 40)
    return (
        f"{name} has ${m}. {name} buys {n} notebooks that cost ${c} each and a pen that costs "
        f"${p}. How much money does {name} have left?",
        [
            step("The notebooks cost {} dollars.", f"{n} * {c}", n * c),
            step("Everything costs {} dollars.", f"{n * c} + {p}", n * c + p),
            step(f"{name} has {{}} dollars left.", f"{m} - {n * c + p}", m - n * c - p),
        ],
        m - n * c - p,
    )


def train_trip(r: random.Random) -> tuple[str, list[str], int]:
    v, h, w, g = r.randint(30, 80), r.randint(2, 5), r.randint(20, 60), r.randint(1, 4)
    return (
        f"A train travels at {v} miles per hour for {h} hours, then at {w} miles per hour for "
        f"{g} hours. How many miles does it travel in total?",
        [
            step("First it travels {} miles.", f"{v} * {h}", v * h),
            step("Then it travels {} miles.", f"{w} * {g}", w * g),
            step("In total it travels {} miles.", f"{v * h} + {w * g}", v * h + w * g),
        ],
        v * h + w * g,
    )


def teams(r: random.Random) -> tuple[str, list[str], int]:
    t = r.randint(3, 6)
    c = r.randint(2, 5)
    s = t * r.randint(4, 8)
    return (
        f"A school has {c} classes with {s} students in each class. For field day the students "
        f"are split into teams of {t}. How many teams are there?",
        [
            step("There are {} students.", f"{c} * {s}", c * s),
            step("There are {} teams.", f"{c * s} / {t}", c * s // t),
        ],
        c * s // t,
    )


def savings(r: random.Random) -> tuple[str, list[str], int]:
    name, per, weeks = r.choice(NAMES), r.randint(5, 15), r.randint(3, 12)
    have = r.randint(10, 60)
    cost = have + per * weeks
    return (
        f"{name} wants to buy a bike that costs ${cost}. {name} has saved ${have} and saves "
        f"${per} every week. How many weeks will it take {name} to have enough money?",
        [
            step(f"{name} still needs {{}} dollars.", f"{cost} - {have}", cost - have),
            step("It will take {} weeks.", f"{cost - have} / {per}", weeks),
        ],
        weeks,
    )


def cookies(r: random.Random) -> tuple[str, list[str], int]:
    name, d, e, n, f = (
        r.choice(NAMES),
        r.randint(3, 6),
        r.randint(2, 6),
        r.randint(2, 5),
        r.randint(2, 5),
    )
    total = 12 * d
    return (
        f"{name} baked {d} dozen cookies. {name} ate {e} of them and gave {f} cookies to each "
        f"of {n} neighbors. How many cookies are left?",
        [
            step(f"{name} baked {{}} cookies.", f"{d} * 12", total),
            step("The neighbors got {} cookies.", f"{f} * {n}", f * n),
            step("There are {} cookies left.", f"{total} - {e} - {f * n}", total - e - f * n),
        ],
        total - e - f * n,
    )


def ages(r: random.Random) -> tuple[str, list[str], int]:
    a, b = r.sample(NAMES, 2)
    x, y, z = r.randint(2, 9), r.randint(5, 30), r.randint(2, 10)
    return (
        f"{a} is {x} years older than {b}. {b} is {y} years old. How old will {a} be in {z} years?",
        [
            step(f"{a} is {{}} years old now.", f"{y} + {x}", x + y),
            step(f"In {z} years {a} will be {{}} years old.", f"{x + y} + {z}", x + y + z),
        ],
        x + y + z,
    )


def discount(r: random.Random) -> tuple[str, list[str], int]:
    d = r.choice([10, 20, 25, 30, 40, 50])
    p = 20 * r.randint(2, 10)
    off = p * d // 100
    return (
        f"A jacket costs ${p}. It is on sale for {d}% off. How much does the jacket cost on sale?",
        [
            step("The discount is {} dollars.", f"{p} * {d} / 100", off),
            step("The jacket costs {} dollars on sale.", f"{p} - {off}", p - off),
        ],
        p - off,
    )


def garden(r: random.Random) -> tuple[str, list[str], int]:
    name, rows, k, t = r.choice(NAMES), r.randint(3, 8), r.randint(4, 10), r.randint(3, 9)
    return (
        f"{name} plants {rows} rows of tomato plants with {k} plants in each row. Each plant "
        f"grows {t} tomatoes. How many tomatoes does {name} grow?",
        [
            step(f"{name} has {{}} plants.", f"{rows} * {k}", rows * k),
            step(f"{name} grows {{}} tomatoes.", f"{rows * k} * {t}", rows * k * t),
        ],
        rows * k * t,
    )


TEMPLATES = [
    packs,
    babysitting,
    book,
    apples,
    notebooks,
    train_trip,
    teams,
    savings,
    cookies,
    ages,
    discount,
    garden,
]


def problems(count: int, r: random.Random) -> list[dict[str, str]]:
    docs = []
    for i in range(count):
        question, steps, answer = TEMPLATES[i % len(TEMPLATES)](r)
        docs.append({"question": question, "answer": "\n".join(steps) + f"\n#### {answer}"})
    r.shuffle(docs)
    return docs


def main() -> None:
    here = Path(__file__).parent
    r = random.Random(8)
    for split, count in (("test", TEST), ("train", TRAIN)):
        lines = [json.dumps(doc) for doc in problems(count, r)]
        (here / f"{split}.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
