"""Types of the C extension shared/_chain.c (see shared/block_hashes.py)."""

def chain_names(
    token_ids: list[int] | tuple[int, ...], block_size: int, start: int, count: int, name: int, /
) -> list[int]: ...
def walk_chain(
    token_ids: list[int] | tuple[int, ...],
    block_size: int,
    count: int,
    seed: int,
    holders: dict[int, int],
    held: int,
    /,
) -> list[tuple[int, int]]: ...
