"""Full-batch nonlinear least squares with LBFGS (strong Wolfe line search) in float64, then float32 polynomial fit."""

import torch


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    x = torch.linspace(-2, 2, 200, dtype=torch.float64)
    y = 1.5 * torch.sin(1.3 * x + 0.4) + 0.2 * x + 0.05 * torch.randn(200, generator=generator, dtype=torch.float64)
    x, y = x.to(device), y.to(device)
    params = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64, device=device, requires_grad=True)
    optimizer = torch.optim.LBFGS([params], lr=1, max_iter=20, history_size=10, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        amplitude, frequency, phase, slope = params
        loss = ((amplitude * torch.sin(frequency * x + phase) + slope * x - y) ** 2).mean()
        loss.backward()
        return loss

    for outer in range(3):
        loss = optimizer.step(closure)
        print(f"outer {outer} loss {loss.item():.10f}")
    print(f"params {[round(v, 8) for v in params.tolist()]}")
    print(f"function evaluations {optimizer.state[params]['func_evals']}")

    # float32: a linear model on polynomial features, a convex problem.
    features = torch.stack([x.float() ** k for k in range(4)], dim=1)
    model = torch.nn.Linear(4, 1).to(device)
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=10)

    def closure32():
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(features).squeeze(1), y.float())
        loss.backward()
        return loss

    for outer in range(2):
        loss = optimizer.step(closure32)
        print(f"float32 outer {outer} loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
