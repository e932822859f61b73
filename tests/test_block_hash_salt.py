"""block_hash.salted_seed: the root of a tenant's chain, against hashlib by hand."""

import hashlib

import pytest

from minillm.block_hash import block_hashes, salted_seed

SEED = bytes(range(32))


def test_no_salt_is_the_seed_and_a_salt_is_sha256_of_seed_tag_salt():
    assert salted_seed(SEED, None) == SEED
    assert salted_seed(SEED, "alice") == hashlib.sha256(SEED + b"cache_salt" + b"alice").digest()
    assert salted_seed(SEED, "é") == hashlib.sha256(SEED + b"cache_salt" + "é".encode()).digest()


def test_two_salts_share_no_block_not_even_the_first():
    tokens = list(range(64))
    chains = [set(block_hashes(tokens, 16, salted_seed(SEED, salt))) for salt in (None, "alice", "bob")]
    assert all(len(c) == 4 for c in chains)
    assert not (chains[0] & chains[1]) and not (chains[0] & chains[2]) and not (chains[1] & chains[2])


@pytest.mark.parametrize("salt", ["", 5, b"alice"])
def test_a_salt_must_be_a_non_empty_string(salt):
    with pytest.raises(ValueError, match="cache_salt"):
        salted_seed(SEED, salt)
