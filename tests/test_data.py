"""DataLoader under the bridge: worker processes, pinning and a custom collate_fn, as in torch."""

from conftest import run_python

SCRIPT = '''
import torch
from torch.utils.data import DataLoader, TensorDataset

def collate(batch):
    xs, ys = zip(*batch)
    return torch.stack(xs), torch.stack(ys)

if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dataset = TensorDataset(torch.arange(40.0).reshape(20, 2), torch.arange(20))
    loader = DataLoader(dataset, batch_size=6, shuffle=True, num_workers=2, pin_memory=True,
                        persistent_workers=True, collate_fn=collate,
                        generator=torch.Generator().manual_seed(0))
    for epoch in range(2):
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            print(epoch, (x * 2).sum().item(), y.tolist(), x.device.type)
'''


def test_dataloader_workers_pinning_collate_match_torch(tmp_path):
    script = tmp_path / "loader.py"
    script.write_text(SCRIPT)
    plain = run_python(str(script), env={"CUDA_VISIBLE_DEVICES": ""})
    bridged = run_python("-m", "bridge", "run", "--quiet", str(script))
    assert plain.returncode == 0, plain.stderr
    assert bridged.returncode == 0, bridged.stderr
    expected = plain.stdout.replace(" cpu\n", " cuda\n")
    assert bridged.stdout == expected
    assert len(bridged.stdout.splitlines()) == 8
    assert "Traceback" not in bridged.stderr
