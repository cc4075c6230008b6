"""Message sizes for the GPU check of the DSL (gpu_dsl_check.py), CPU only so that
test_dsl_plans.py proves them: a plan runs only at input sizes within its runnable range
(`mscclpp.Algorithm.message_size_range`: the plan's own range capped by the scratch and staging
its set-up gets), and a size outside it is refused by the executor. So each wanted size is run
where it fits, and otherwise replaced by the nearest size that does (or left out where none does,
said in the output)."""

# Elements per chunk of the plan: small, odd-ish multiple of 16-byte words, and large.
CHUNK_ELEMS = (64, 64 * 33, 64 * 1024)
# Replacement sizes stay multiples of this many elements (whole 16-byte words for every dtype).
STEP = 64


def chunk_sizes(message_range, in_chunks, itemsize, wanted=CHUNK_ELEMS):
    """`(sizes, notes)`: elements per chunk to run, in order without repeats, each giving an input
    of `in_chunks * elems * itemsize` bytes within `message_range` (min, max), and a note for each
    wanted size that was replaced or left out."""
    lo, hi = message_range
    per_elem = max(1, in_chunks) * itemsize
    sizes, notes = [], []
    for elems in wanted:
        got = elems
        if elems * per_elem > hi:
            got = hi // per_elem // STEP * STEP
        elif elems * per_elem < lo:
            least = -(-lo // per_elem)  # whole elements covering `lo` bytes
            got = -(-least // STEP) * STEP
        fits = got > 0 and lo <= got * per_elem <= hi
        if got != elems:
            what = f"ran {got}/chunk instead" if fits else "left out: nothing of whole words fits"
            notes.append(f"{elems}/chunk ({elems * per_elem} bytes) is outside the runnable range "
                         f"{lo}..{hi} bytes: {what}")
        if fits and got not in sizes:
            sizes.append(got)
    return sizes, notes
