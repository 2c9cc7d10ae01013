"""The prompt stream's position is state: a stream restored at batch k yields exactly what an
uninterrupted stream yields from k on: one dataset, a mixture, two ranks, across epoch boundaries,
with DataLoader workers prefetching."""

import PIL.Image
import pytest

from mmgrpo.data.catalog import mix_datasets
from mmgrpo.data.prompt_batches import PromptStream, cycle, make_prompt_loader
from mmgrpo.data.sample import Sample
from mmgrpo.errors import ConfigError


class Pictures:
    """Ten image samples, each its own picture (a grey level per row)."""

    name, split = "pictures", "train"

    def __init__(self, root):
        self.root = str(root)
        for index in range(10):
            PIL.Image.new("RGB", (4, 4), (index * 20,) * 3).save(root / f"{index}.png")

    def __len__(self):
        return 10

    def __getitem__(self, index):
        return Sample(id=f"pictures/train/{index}", messages=[{"role": "user", "content": "<image>level?"}],
                      images=[f"{index}.png"], columns={"solution": str(index)}, media_root=self.root)


def seen(batch):
    """What a batch holds: each sample id with a digest of its decoded image."""
    return [(sample.id, loaded.images[0].getpixel((0, 0)) if loaded.images else None) for sample, loaded in batch]


def stream_of(dataset, *, num_workers=2, rank=0, world_size=1, batch_size=4, seed=0, state=None):
    loader = make_prompt_loader(dataset, batch_size=batch_size, seed=seed, num_workers=num_workers,
                                prefetch_factor=2, rank=rank, world_size=world_size)
    return PromptStream(loader, state)


def check_resume(make_stream, total, stops):
    uninterrupted = [seen(batch) for batch, _ in zip(make_stream(), range(total))]
    for stop in stops:
        first = make_stream()
        for _ in range(stop):
            next(first)
        state = first.state_dict()
        resumed = make_stream(state=state)
        assert [seen(next(resumed)) for _ in range(total - stop)] == uninterrupted[stop:], f"restored at batch {stop}"
    return uninterrupted


def test_one_dataset_resumes_exactly_across_epochs(tmp_path):
    dataset = Pictures(tmp_path)  # 10 rows, batches of 4: 2 per epoch (drop_last), 2 rows left out each epoch
    batches = check_resume(lambda state=None: stream_of(dataset, state=state), total=7, stops=[1, 2, 3, 5])
    assert batches[0] != batches[2]  # reshuffled per epoch
    stream = stream_of(dataset, num_workers=0)
    for _ in range(3):
        next(stream)
    assert {k: stream.state_dict()[k] for k in ("epoch", "batch", "batch_size", "rows")} == {"epoch": 1, "batch": 1, "batch_size": 4, "rows": 10}


def test_a_mixture_resumes_exactly_and_reports_each_dataset(tmp_path):
    mixture = mix_datasets(["shapes-color:0.7", "shapes-count:0.3"], split="train", seed=3)
    check_resume(lambda state=None: stream_of(mixture, seed=3, batch_size=8, state=state), total=5, stops=[2, 4])
    stream = stream_of(mixture, seed=3, batch_size=8, num_workers=0)
    ids = [sample.id for _ in range(3) for sample, _ in next(stream)]
    state = stream.state_dict()
    assert state["per_dataset"] == {"shapes-color": sum(i.startswith("shapes-color/") for i in ids),
                                    "shapes-count": sum(i.startswith("shapes-count/") for i in ids)}
    assert [source[0] for source in state["sources"]] == ["shapes-color", "shapes-count"]


def test_two_ranks_each_resume_their_own_share(tmp_path):
    dataset = Pictures(tmp_path)  # 5 rows per rank, batches of 2: 2 per epoch
    shares = []
    for rank in (0, 1):
        shares.append(check_resume(
            lambda state=None, rank=rank: stream_of(dataset, rank=rank, world_size=2, batch_size=2, state=state),
            total=5, stops=[1, 2, 3],
        ))
    for epoch in range(2):  # within an epoch, the ranks' rows are disjoint
        rows = [{sid for sid, _ in batch} for share in shares for batch in share[2 * epoch : 2 * epoch + 2]]
        assert len(set().union(*rows)) == sum(len(r) for r in rows) == 8


def test_a_state_of_other_data_or_batch_size_is_refused(tmp_path):
    dataset = Pictures(tmp_path)
    state = stream_of(dataset, num_workers=0).state_dict()
    with pytest.raises(ConfigError, match="the saved prompt stream had batch_size 4, this run's has 2: resume with the same"):
        stream_of(dataset, num_workers=0, batch_size=2, state=state)
    with pytest.raises(ConfigError, match="had seed 0, this run's has 1"):
        stream_of(dataset, num_workers=0, seed=1, state=state)


def test_cycle_is_a_stream():
    assert isinstance(cycle(make_prompt_loader(list(range(4)), batch_size=2, num_workers=0)), PromptStream)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_stream_draws_nothing_from_torchs_global_rng(tmp_path, num_workers):
    """A resumed run starts its loader at another step than the uninterrupted one: if starting it
    drew from the global RNG (DataLoader's worker seed does by default), that step would sample
    other completions."""
    import torch

    stream = stream_of(Pictures(tmp_path), num_workers=num_workers)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    for _ in range(3):  # the first iterator, and a new epoch's
        next(stream)
    assert torch.equal(torch.rand(3), expected)
