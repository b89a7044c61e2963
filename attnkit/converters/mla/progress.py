"""One progress bar over a conversion's walks through the layers (the RoPE-score pre-pass, then the
conversion itself), so that its ETA is for the whole conversion, not for the walk it is in."""

from __future__ import annotations

from collections.abc import Iterator

from tqdm.auto import tqdm

PRE_PASS_READS = 2  # times the pre-pass reads its rows per layer: the moment, the layer's forward
CONVERT_READS = 5  # the conversion's: the moment, the latent refits (2), the attention, the MLP


def pre_pass_rows(calib_rows: int) -> int:
    """Calibration rows the RoPE-score pre-pass uses: scores only rank components, a quarter is enough."""
    return max(4, calib_rows // 4)


class ConversionProgress:
    """Each layer of a walk counts as the calibration rows it pushes through that layer times the
    times it reads them (`PRE_PASS_READS`, `CONVERT_READS`): the pre-pass's layers are that much
    cheaper than the conversion's, so the ETA is about right from the first layer on (tqdm's rate
    then corrects it as it goes)."""

    def __init__(self, name: str, layers: int, calib_rows: int, pre_pass: bool, disable: bool = False):
        self.layers = layers
        self.weights = {"convert": CONVERT_READS * calib_rows}
        if pre_pass:
            self.weights = {"rope scores": PRE_PASS_READS * pre_pass_rows(calib_rows), **self.weights}
        self.bar = tqdm(total=layers * sum(self.weights.values()), desc=f"{name}: convert --to mla", disable=disable,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]{postfix}")

    def walk(self, what: str) -> Iterator[int]:
        """The layers of the walk `what` ("rope scores" or "convert"), the bar advanced after each."""
        for layer in range(self.layers):
            self.bar.set_postfix_str(f"{what}, layer {layer + 1}/{self.layers}")
            yield layer
            self.bar.update(self.weights[what])

    def close(self) -> None:
        self.bar.close()
