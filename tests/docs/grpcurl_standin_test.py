"""grpcurl_standin.py reads its command line as grpcurl does (Go's `flag`
package), so that docs/protocol.md's examples, run with the stand-in, would
fail where they would fail with the real grpcurl: `-unix` is a boolean (the
address is the first argument after the flags), flags stop at the first
argument that is not one, and a boolean takes a value only after `=`.

Socket paths, bodies and method names are fresh random ones each run.
"""
from __future__ import annotations

import random
import string
import unittest

import grpcurl_standin as standin
import junit_runner


def _word(rng: random.Random, n: int = 8) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))


class CommandLineTest(unittest.TestCase):

    def setUp(self) -> None:
        seed = random.SystemRandom().randrange(1 << 32)
        self.rng = random.Random(seed)
        self.seed = seed
        self.sock = f"/tmp/{_word(self.rng)}/{_word(self.rng)}.sock"
        self.method = f"pkg{_word(self.rng, 3)}.v1.{_word(self.rng).capitalize()}/" \
                      f"{_word(self.rng).capitalize()}"
        self.body = '{"%s": %d}' % (_word(self.rng), self.rng.randrange(1 << 20))

    def parse(self, argv):
        return standin.parse_command_line(argv)

    def refused(self, argv, text: str) -> None:
        with self.assertRaises(standin.Usage, msg=f"{argv} (seed {self.seed})") as raised:
            self.parse(argv)
        self.assertIn(text, str(raised.exception))

    def test_unix_is_a_boolean_and_the_address_is_positional(self) -> None:
        flags, positional = self.parse(["-plaintext", "-unix", self.sock, "list"])
        self.assertTrue(flags["unix"])
        self.assertTrue(flags["plaintext"])
        self.assertEqual(positional, [self.sock, "list"])
        # The docs' form: S="-plaintext -unix PATH", the body before it.
        flags, positional = self.parse(["-d", self.body, "-plaintext", "-unix", self.sock,
                                        self.method])
        self.assertEqual(flags["d"], self.body)
        self.assertEqual(positional, [self.sock, self.method])
        # Go's other spellings of the same flags.
        for spelled in (["--unix", "--plaintext"], ["-unix=true", "-plaintext=1"],
                        ["-unix=T", "--plaintext=TRUE"]):
            flags, positional = self.parse(spelled + [f"-d={self.body}", self.sock, self.method])
            self.assertTrue(flags["unix"], spelled)
            self.assertEqual(flags["d"], self.body)
            self.assertEqual(positional, [self.sock, self.method])
        flags, _ = self.parse(["-unix=false", "-plaintext", self.sock, "list"])
        self.assertFalse(flags["unix"])

    def test_unix_does_not_take_the_path(self) -> None:
        self.refused([f"-unix={self.sock}", "-plaintext", "list"],
                     f'invalid boolean value "{self.sock}" for -unix')
        # `-unix PATH` with nothing after the path: PATH is the address, no verb.
        self.refused(["-plaintext", "-unix", self.sock], "Too few arguments")
        # The path read as -unix's value would leave `list` as the address.
        self.refused(["-plaintext", "-unix", "list"], "Too few arguments")

    def test_flags_stop_at_the_first_positional(self) -> None:
        self.refused(["-plaintext", self.sock, "-unix", "list"], "Too many arguments")
        self.refused(["-plaintext", "-unix", self.sock, self.method, "-d", self.body],
                     "Too many arguments")
        flags, positional = self.parse(["-plaintext", "--", "-weird", "list"])
        self.assertFalse(flags["unix"])
        self.assertEqual(positional, ["-weird", "list"])

    def test_verbs_take_what_grpcurl_takes(self) -> None:
        symbol = f"pkg.{_word(self.rng).capitalize()}"
        self.assertEqual(self.parse(["-plaintext", self.sock, "list", symbol])[1],
                         [self.sock, "list", symbol])
        self.assertEqual(self.parse(["-plaintext", self.sock, "describe", symbol])[1],
                         [self.sock, "describe", symbol])
        self.refused(["-plaintext", self.sock, "list", symbol, "extra"], "Too many arguments")
        self.refused(["-plaintext", self.sock, self.method, "extra"], "Too many arguments")
        self.refused([f"-{_word(self.rng)}", self.sock, "list"], "flag provided but not defined")
        self.refused(["-plaintext", "-d"], "flag needs an argument: -d")


if __name__ == "__main__":
    junit_runner.main()
