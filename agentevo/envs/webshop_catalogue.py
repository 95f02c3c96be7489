"""The local WebShop's generated catalogue, its shopping goals, and WebShop's purchase reward.

Everything here is a pure function of (seed, n_products): the same arguments give the same products, goals and
splits on every machine. The reward follows the structure of WebShop's `get_reward` (attribute, option, price
and type terms); where WebShop needs spaCy or fuzzy string matching, the generated data lets us use exact rules
(see `purchase_reward`).
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Any

from agentevo.envs.bm25 import BM25, tokenize

# WebShop draws the price bound from multiples of 10 above the product's price.
PRICE_RANGE = [10.0 * i for i in range(1, 100)]

# category -> departments (department -> product types), attribute pool, option groups, price range.
# Vocabulary rules that keep the exact-match reward honest (checked by `check_catalogue` in the tests):
# no option value occurs in any product text, and no attribute phrase is a substring of another one.
CATEGORIES: dict[str, dict[str, Any]] = {
    "beauty": {
        "departments": {
            "skin care": ["face cream", "body lotion", "lip balm"],
            "hair care": ["shampoo", "hair mask", "conditioner"],
        },
        "attributes": [
            "paraben free", "cruelty free", "long lasting", "dermatologist tested",
            "vegan formula", "travel friendly", "sulfate free", "non greasy",
        ],
        "options": {
            "size": ["1.7 ounce", "3.4 ounce", "6.8 ounce", "12 ounce"],
            "scent": ["lavender", "coconut", "vanilla", "citrus", "unscented"],
        },
        "price": (6.0, 45.0),
    },
    "electronics": {
        "departments": {
            "audio": ["earbuds", "portable speaker", "headphones"],
            "phone accessories": ["phone case", "charging cable", "power bank"],
        },
        "attributes": [
            "fast charging", "noise cancelling", "water resistant", "long battery life",
            "lightweight design", "shockproof", "high definition", "easy to install",
        ],
        "options": {
            "color": ["black", "white", "navy blue", "rose gold", "silver"],
            "pack": ["1 pack", "2 pack", "3 pack"],
        },
        "price": (10.0, 90.0),
    },
    "fashion": {
        "departments": {
            "men": ["t-shirt", "hoodie", "sneakers"],
            "women": ["sweater", "leggings", "sandals"],
        },
        "attributes": [
            "machine washable", "quick drying", "slim fit", "moisture wicking",
            "non slip sole", "breathable", "wrinkle resistant", "classic style",
        ],
        "options": {
            "size": ["small", "medium", "large", "x-large", "xx-large"],
            "color": ["black", "white", "heather grey", "olive green", "burgundy"],
        },
        "price": (12.0, 70.0),
    },
    "food": {
        "departments": {
            "snacks": ["granola bars", "trail mix", "protein cookies"],
            "beverages": ["green tea", "coffee beans", "hot cocoa"],
        },
        "attributes": [
            "gluten free", "non gmo", "low sugar", "high protein",
            "organic", "keto friendly", "individually wrapped", "caffeine free",
        ],
        "options": {
            "flavor": ["dark chocolate", "honey almond", "peanut butter", "classic", "mixed berry"],
            "size": ["6 count", "12 count", "24 count"],
        },
        "price": (5.0, 40.0),
    },
    "furniture": {
        "departments": {
            "living room": ["coffee table", "bookshelf", "armchair"],
            "office": ["desk chair", "standing desk", "filing cabinet"],
        },
        "attributes": [
            "easy assembly", "solid wood", "space saving", "heavy duty",
            "scratch resistant", "adjustable height", "ergonomic design", "mid century",
        ],
        "options": {
            "color": ["walnut", "oak", "espresso", "white", "grey"],
        },
        "price": (40.0, 300.0),
    },
}

# Share of products that copy the attributes of an earlier product of the same type (see _generate).
FAMILY_SHARE = 0.5

# Filler text: must contain no option value and no attribute phrase of any category.
_DESCRIPTION_OPENERS = [
    "Designed for everyday use and built to last.",
    "A thoughtful pick for home, work or travel.",
    "Made by a team that cares about the details.",
    "Our most popular model, now with an improved build.",
]
_FEATURE_TAILS = [
    "tested by our quality team",
    "a customer favourite",
    "made with care",
    "backed by our one year warranty",
]
_REVIEWS = [
    "Exactly as described, would buy again.",
    "Good value for the price.",
    "Arrived quickly and works well.",
    "Decent quality, packaging could be better.",
    "My second one, still happy with it.",
]
_OPENERS = ["i need", "i am looking for", "i want to buy", "find me", "i would like"]
_SYLLABLES = ["ka", "lo", "mi", "ren", "sa", "tor", "vel", "dra", "nu", "bel", "fi", "gor", "ha", "zen", "ul", "vo"]


@dataclass(frozen=True)
class Product:
    """One product of the local shop."""

    asin: str
    category: str
    department: str
    product_type: str
    brand: str
    title: str
    attributes: tuple[str, ...]
    options: dict[str, tuple[str, ...]] = field(hash=False, compare=False)
    price: float
    description: str
    features: tuple[str, ...]
    reviews: tuple[str, ...]

    @property
    def breadcrumb(self) -> tuple[str, str, str]:
        """WebShop's product_category path (category > department > type)."""
        return (self.category, self.department, self.product_type)

    def text(self) -> str:
        """Everything a shopper can read about the product (what search indexes and the reward's fallback reads)."""
        return " ".join([self.title, self.description, *self.features, *self.attributes])


@dataclass(frozen=True)
class Catalogue:
    """Products in a fixed order, an index by ASIN, one goal per product, and a BM25 index over product text."""

    seed: int
    products: tuple[Product, ...]
    by_asin: dict[str, Product] = field(hash=False, compare=False)
    goals: tuple[dict[str, Any], ...] = field(hash=False, compare=False)
    index: BM25 = field(hash=False, compare=False)

    @property
    def key(self) -> str:
        """Identifies the catalogue inside task params, so a task is never replayed on a different shop."""
        return f"local:seed={self.seed},n={len(self.products)}"

    def search(self, query: str, limit: int = 50) -> list[Product]:
        """Products ranked by BM25 over their text; WebShop shows at most the top 50."""
        return [self.products[i] for i, _ in self.index.top(tokenize(query), limit)]


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _brands(rng: random.Random, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 3)))).capitalize()
        if name not in out:
            out.append(name)
    return out


def _price_upper(rng: random.Random, price: float) -> float:
    # WebShop's rule: take the first four multiples of 10 above the price, sample two, keep the larger.
    candidates = [p for p in PRICE_RANGE if p > price][:4]
    return max(rng.sample(candidates, 2))


def instruction_keywords(goal: dict[str, Any]) -> str:
    """The search words a sensible shopper takes from a goal: its attributes and the product type."""
    return " ".join([*goal["attributes"], goal["product_type"]])


def _make_goal(rng: random.Random, p: Product) -> dict[str, Any]:
    picked = rng.sample(list(p.attributes), 2)
    attrs = [a for a in p.attributes if a in picked]  # keep catalogue order so the text reads the same way
    options = {g: rng.choice(vals) for g, vals in p.options.items()}
    upper = _price_upper(rng, p.price)
    opts_text = " and ".join(f"{g}: {v}" for g, v in options.items())
    text = (
        f"{rng.choice(_OPENERS)} {_a(attrs[0])} {' and '.join(attrs)} {p.product_type} with {opts_text}, "
        f"and price lower than {upper:.2f} dollars"
    )
    return {
        "asin": p.asin,
        "instruction": text,
        "category": p.category,
        "department": p.department,
        "product_type": p.product_type,
        # WebShop compares the nouns of the target's name; in generated titles those are the brand and type words.
        "name_nouns": sorted(set(tokenize(f"{p.brand} {p.product_type}"))),
        "attributes": attrs,
        "options": options,
        "price_upper": upper,
    }


def _generate(seed: int, n_products: int) -> Catalogue:
    rng = random.Random(seed)
    products: list[Product] = []
    asins: set[str] = set()
    cats = sorted(CATEGORIES)
    per_cat = [n_products // len(cats) + (1 if i < n_products % len(cats) else 0) for i in range(len(cats))]
    for cat, n_cat in zip(cats, per_cat, strict=True):
        spec = CATEGORIES[cat]
        types = [(dep, t) for dep, ts in spec["departments"].items() for t in ts]
        brands = _brands(rng, 12)
        lo, hi = spec["price"]
        same_type: dict[str, list[list[str]]] = {}
        for j in range(n_cat):
            dep, ptype = types[j % len(types)]
            brand = rng.choice(brands)
            earlier = same_type.setdefault(ptype, [])
            if earlier and rng.random() < FAMILY_SHARE:
                # A near-twin of an earlier product: same attributes (so search ranks them alike) but its own
                # options and price, so the shopper has to read the item page to pick the right one.
                attrs = list(rng.choice(earlier))
            else:
                picked = rng.sample(spec["attributes"], 3)
                attrs = [a for a in spec["attributes"] if a in picked]
            earlier.append(attrs)
            options: dict[str, tuple[str, ...]] = {}
            for g, vals in spec["options"].items():
                chosen = rng.sample(vals, rng.randint(2, max(2, len(vals) - 1)))  # never every value: options matter
                options[g] = tuple(v for v in vals if v in chosen)
            shown = rng.sample(attrs, 2)
            title = f"{brand} {ptype.title()}, {shown[0].title()}, {shown[1].title()}"
            description = f"{rng.choice(_DESCRIPTION_OPENERS)} This {ptype} by {brand} is {', '.join(attrs[:-1])} and {attrs[-1]}."
            features = tuple(f"{a.upper()} - {rng.choice(_FEATURE_TAILS)}" for a in attrs)
            reviews = tuple(f"Rating: {rng.randint(3, 5)} out of 5 [SEP] {r}" for r in rng.sample(_REVIEWS, 2))
            while True:
                asin = "B0" + "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ0123456789") for _ in range(8))
                if asin not in asins:
                    asins.add(asin)
                    break
            products.append(
                Product(
                    asin=asin, category=cat, department=dep, product_type=ptype, brand=brand, title=title,
                    attributes=tuple(attrs), options=options, price=round(rng.uniform(lo, hi), 2),
                    description=description, features=features, reviews=reviews,
                )
            )
    goals = tuple(_make_goal(rng, p) for p in products)
    index = BM25([tokenize(p.text()) for p in products])
    return Catalogue(seed, tuple(products), {p.asin: p for p in products}, goals, index)


_CACHE: dict[tuple[int, int], Catalogue] = {}
_LOCK = threading.Lock()


def get_catalogue(seed: int, n_products: int) -> Catalogue:
    """The catalogue for (seed, n_products), built once per process (worker pools share it; it is read-only)."""
    with _LOCK:
        key = (seed, n_products)
        if key not in _CACHE:
            _CACHE[key] = _generate(seed, n_products)
        return _CACHE[key]


def split_goal_indices(cat: Catalogue, seed: int) -> dict[str, list[int]]:
    """Goal indices per split: products are held out per category (1/6 test, 1/12 dev, rest train); lists interleave
    the categories so that any head of a list covers every category."""
    rng = random.Random(f"splits-{seed}")
    by_cat: dict[str, dict[str, list[int]]] = {}
    for c in sorted(CATEGORIES):
        idx = [i for i, p in enumerate(cat.products) if p.category == c]
        rng.shuffle(idx)
        n_test, n_dev = max(1, len(idx) // 6), max(1, len(idx) // 12)
        by_cat[c] = {"test": idx[:n_test], "dev": idx[n_test : n_test + n_dev], "train": idx[n_test + n_dev :]}
    out: dict[str, list[int]] = {}
    for split in ("train", "dev", "test"):
        lists = [by_cat[c][split] for c in sorted(by_cat)]
        longest = max(len(x) for x in lists)
        out[split] = [x[k] for k in range(longest) for x in lists if k < len(x)]
    return out


def purchase_reward(
    product: Product, goal: dict[str, Any], price: float, options: dict[str, str]
) -> tuple[float, dict[str, Any]]:
    """WebShop's reward for buying `product` with the chosen `options` against `goal`.

    total = r_type * (n_attr + n_opt + r_price) / (len(goal attributes) + len(goal options) + 1), where
      n_attr  = goal attributes found in the product's attribute list or its title / features / description,
      n_opt   = chosen option values that equal a goal option value, or that occur in the product text,
      r_price = 1 if price <= goal price bound else 0,
      r_type  = 1 if (same product type or >= 2 shared breadcrumb levels or title_score > 0.2) else 0.5,
                then 0.1 if title_score < 0.1 and 0 if title_score == 0, with title_score = share of the target
                name's nouns (brand + type words) that occur in the bought product's title.
    WebShop matches attributes and options with fuzzy ratios > 85; the generated vocabulary has no near-duplicates,
    so exact matching gives the same answer here.
    """
    text = product.text().lower()
    n_attr = sum(1 for a in goal["attributes"] if a in product.attributes or a in text)
    goal_values = set(goal["options"].values())
    n_opt = sum(1 for v in options.values() if v in goal_values or v in text)
    r_price = 1 if price <= goal["price_upper"] else 0

    query_match = product.product_type == goal["product_type"]
    goal_crumb = {goal["category"], goal["department"], goal["product_type"]}
    category_match = len(set(product.breadcrumb) & goal_crumb) >= 2
    nouns = set(goal["name_nouns"])
    title_score = len(nouns & set(tokenize(product.title))) / len(nouns) if nouns else 0.2
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0

    denom = len(goal["attributes"]) + len(goal["options"]) + 1
    total = r_type * (n_attr + n_opt + r_price) / denom
    parts = {
        "r_type": r_type,
        "r_att": n_attr / len(goal["attributes"]) if goal["attributes"] else None,
        "r_option": n_opt / len(goal["options"]) if goal["options"] else None,
        "r_price": r_price,
        "query_match": query_match,
        "category_match": category_match,
        "title_score": title_score,
    }
    return total, parts


def check_catalogue(cat: Catalogue) -> list[str]:
    """Problems that would make exact matching disagree with WebShop's fuzzy matching (empty list = none)."""
    problems: list[str] = []
    for p in cat.products:
        text = p.text().lower()
        for vals in p.options.values():
            for v in vals:
                if v in text:
                    problems.append(f"{p.asin}: option value {v!r} occurs in the product text")
        for a in CATEGORIES[p.category]["attributes"]:
            if a not in p.attributes and a in text:
                problems.append(f"{p.asin}: attribute {a!r} occurs in the text but is not an attribute")
    return problems
