"""Feature extraction with forward hooks (and a forward pre-hook and a full backward hook) on a small CNN."""

import torch
import torch.nn as nn


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 5)
    ).to(device)
    features, inputs_seen, gradients = {}, [], {}

    def save_output(name):
        def hook(module, args, output):
            features[name] = output.detach()
        return hook

    handles = [model[1].register_forward_hook(save_output("relu1")), model[3].register_forward_hook(save_output("relu2"))]
    handles.append(model[6].register_forward_pre_hook(lambda module, args: inputs_seen.append(args[0].shape)))
    handles.append(model[2].register_full_backward_hook(lambda module, grad_in, grad_out: gradients.update(conv2=grad_out[0].detach())))
    # A hook that changes the output: scale the logits.
    handles.append(model[6].register_forward_hook(lambda module, args, output: output * 0.5))

    images = torch.randn(4, 1, 10, 10, generator=generator).to(device)
    logits = model(images)
    logits.sum().backward()
    for name, value in features.items():
        print(f"{name} shape {list(value.shape)} mean {value.mean().item():.6f} active {(value > 0).float().mean().item():.6f}")
    print(f"head input shape {list(inputs_seen[0])}")
    print(f"conv2 grad_out norm {gradients['conv2'].norm().item():.6f}")
    print(f"logits {logits.sum().item():.6f} conv1 grad {model[0].weight.grad.abs().sum().item():.6f}")
    for handle in handles:
        handle.remove()
    features.clear()
    model(images)
    print(f"after remove captured {len(features)}")


if __name__ == "__main__":
    main()
