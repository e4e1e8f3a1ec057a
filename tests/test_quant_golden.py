"""Golden bytes: the sha256 of every encoder's output on one fixed seeded matrix is pinned, so any
change to an encoder's bytes is deliberate (update the pin in the same commit and say why).

The 4- and 2-bit group dtypes and vbit have two encoders: ``encoder="reference"`` pins the reference's
bytes (REFERENCE_NOTES §1.8, unchanged since they were first pinned); the default pins are the
``mse`` encoder's (cmf.quant.mse)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import cmf.quant as q


def golden_matrix() -> np.ndarray:
    """40 × 160 Gaussian rows of varied amplitude, with a zero row, a dead group and scattered zeros."""
    rng = np.random.default_rng(20240601)
    w = rng.standard_normal((40, 160)).astype(np.float32)
    w *= np.exp2(rng.normal(0, 1, size=(40, 1))).astype(np.float32) * np.float32(0.02)
    w[5] = 0
    w[9, 64:96] = 0
    w[13, ::7] = 0
    return w


PINNED = {
    ("f32", ()): "1b2c4267f3b3a06157d9c1fd789b70ebbb8716b50cc96a6804df2141290379ec",
    ("f16", ()): "08c9ce1489a904f221154099d3bb694123021f50ba043532272da8d4b73ca184",
    ("bf16", ()): "915b00a147d1c560672eb6bf43791f532a708c455f29c3117b942ba612588029",
    ("q8_row", ()): "9f828ac77174ac16e7bb82be74257fd78e79c63bd7501ae76672fcc46b8da892",
    ("q4_block", (('encoder', 'reference'),)): "9a7ccdcb92ae6f2b02dd41f9cd49291f26419d9a8b9b8966f0f18cd3e58f38e4",
    ("q4_block", ()): "f0520ba77a2286ea9d809bd48fd5ee7cfee436815fef43e93b8ff34c6aa5776a",
    ("q8_2f", ()): "e75cc783eed34d6c37baa7804774b1cd0a64f48a351c4167f8849334e9cc276c",
    ("vbit", (('encoder', 'reference'),)): "e7d3f7c79701ebf84f49902db3ef469786b119faaba2ee50bc01ad8815d449b0",
    ("vbit", (('encoder', 'reference'), ('mean_bits', 3.5))): "426b95e95ff8d2aa108e9de99c21049065b00ce6ea3d81fd187bb81aa6e4a47d",
    ("vbit_ro", (('encoder', 'reference'),)): "30c5dd962a3f56368e9b3ff4d3618d11cb84a88bb420f54156027b4e47afcd77",
    ("vbit", ()): "5ab262f4e699680fadc7cc84e58f1255354f2ce4952372a924a5118a8b796ab4",
    ("vbit", (('mean_bits', 3.5),)): "7ebf6557f1a81edfa979a5f3d8d8a83fc5a6b6a2cf0ee7e91357b48143ee9222",
    ("vbit_ro", ()): "1f3a66fd9e0f1b068b761f77e96104ac0e54227458af4dc65881916b180b3390",
    ("q4_tiled", (('encoder', 'reference'),)): "6c0f7ad0be8173df9460f751d3bbf91be3f2028d82e8d5e9c7580598ebec18d5",
    ("q4_tiled", ()): "1f095ac693fb1522192d6235f31b42ffc68e9bbc45eb71cb694dc792e7ea4564",
    ("q4tp", (('encoder', 'reference'),)): "8edf27dc2cc3bbc879308049055c4af88db6d7da736b9bca342475c77d2109ef",
    ("q4tp", (('encoder', 'reference'), ('search', False))): "91ab5aa3f1d9ed7235160dc5377a805a2c52f811428a27533a69ec730ac21445",
    ("q4tp", ()): "168c2c175de72cacf1bc2cf2c4968124b3c5bd22aa477e1f1521b07e67dfb1d2",
    ("q2tp", (('encoder', 'reference'),)): "1139d01f9153fee1c3b36c60f99bb749042de7d868191fff8f66b214e854fd1c",
    ("q2tp", (('encoder', 'reference'), ('search', False))): "320f3614139b861ea7c18bb530f35ee2c62e2a1a89a4642da0e31b6d09e8f9f0",
    ("q2tp", ()): "43791ed265202c65d4782a698191af4e5b6178ed63ee1830c3b2feee1860a00d",
    ("q1", ()): "ee195d878125765c527303e96f6b60e3db3d98ff9951d70a79eb431197780610",
    ("q1p", ()): "d600df9f7a4d25ffa69f4bd97ee8cc15620c072b86fee0d8566cd2fb50239b83",
    ("q1s", ()): "bde9033736cac096ab13f513c342488c44c01076c0bc95b60bf394ab3a6a6b74",
    ("q1s", (('keep', 0.05),)): "6d1d57aa2c6d9ef620cc798d969ac8dabfda6206f9c5a34f13deca8baadee0c5",
    ("q1t", ()): "69dd32c0b758579e9231b8bf2c23c00b0b1fef4b77b217284d8b889d95763ada",
    ("q1t", (('act_rms', 'ramp'), ('keep', 0.02))): "83aad6aacec5f3d8af31bcb163886d83ca05a3d72d4e517d05a3399b53211668",
}


@pytest.mark.parametrize(("name", "opts"), [(k[0], k[1]) for k in PINNED], ids=[k[0] + "".join(f"-{a}={b}" for a, b in k[1]) for k in PINNED])
def test_encoder_bytes_are_pinned(name: str, opts: tuple) -> None:
    o = dict(opts)
    if o.get("act_rms") == "ramp":
        o["act_rms"] = np.linspace(0.25, 4.0, 160, dtype=np.float32)
    data = q.encode(golden_matrix(), name, **o)
    assert hashlib.sha256(data).hexdigest() == PINNED[(name, opts)]
