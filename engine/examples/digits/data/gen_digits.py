"""Writes the digits example's fixture: scikit-learn's 8x8 handwritten digits (1,797 images,
the UCI "Optical Recognition of Handwritten Digits" test set, CC BY 4.0), shuffled with a
fixed seed and split into 1,437 training and 360 test images (80/20).

Each file holds one record per image: 64 pixel bytes (0..16, row-major) then the label byte.

    python -m pip install scikit-learn
    python gen_digits.py            # or: python gen_digits.py path/to/digits.csv.gz
"""
import gzip
import os
import random
import sys


def rows(path=None):
    if path is None:
        import sklearn.datasets

        path = os.path.join(os.path.dirname(sklearn.datasets.__file__), "data", "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        for line in f:
            values = [int(float(v)) for v in line.split(",")]
            assert len(values) == 65 and all(0 <= v <= 16 for v in values[:64]), line
            yield bytes(values)


def main():
    records = list(rows(sys.argv[1] if len(sys.argv) > 1 else None))
    assert len(records) == 1797, len(records)
    random.Random(20261127).shuffle(records)
    cut = len(records) * 4 // 5
    here = os.path.dirname(os.path.abspath(__file__))
    for name, part in [("train.u8", records[:cut]), ("test.u8", records[cut:])]:
        with open(os.path.join(here, name), "wb") as f:
            f.write(b"".join(part))
        print(name, len(part), "images")


if __name__ == "__main__":
    main()
