"""sluice/ids.py: ids from a page of random bytes, never the same twice, in a forked child too."""

from __future__ import annotations

import os

from sluice import ids
from sluice.ids import random_hex


def test_ids_are_uuid4_hex_and_unique_across_pages() -> None:
    made = [random_hex() for _ in range(3 * ids._PAGE // 16)]  # three pages
    assert len(set(made)) == len(made)
    assert all(len(i) == 32 and i[12] == "4" and i[16] in "89ab" for i in made)


def test_a_forked_child_hands_out_ids_of_its_own() -> None:
    random_hex()  # the parent's page is in use
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the id it makes next, had it kept the parent's page, is the parent's next
        os.write(write, random_hex().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    os.close(write)
    assert child != random_hex()
