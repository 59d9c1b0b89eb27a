"""Row builders named by data.source = "python:tests.data_builders:<fn>" in tests/test_data_loaders.py; the ranks
of a run import them as the trainer does."""


def additions(split, count=8, start=0):
    """`count` addition problems; the test split starts 1000 further on, so the two never share a prompt."""
    first = start + (1000 if split == "test" else 0)
    return [{"question": f"What is {i} + {i % 7}?", "answer": str(i + i % 7)} for i in range(first, first + count)]


def generated(split):
    """Rows from a generator, as a builder may yield them."""
    yield {"question": "What is 1 + 1?", "answer": "2"}
    yield {"question": "What is 2 + 2?", "answer": "4"}


def not_rows(split):
    return ["What is 1 + 1?"]


def broken(split, count=1):
    raise FileNotFoundError(f"no {split} file")
