"""The transformers tests need the `transformers` extra; without it they are skipped."""

import pytest

pytest.importorskip("transformers")
