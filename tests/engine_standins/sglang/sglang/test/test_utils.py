"""Stand-in for ``sglang.test.test_utils`` (tests only)."""

import unittest


class CustomTestCase(unittest.TestCase):
    """SGLang's base test case; its retry and timing hooks are not needed here."""
