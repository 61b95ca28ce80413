"""The names users reach from `import archlab` resolve in a fresh interpreter, whatever room they live in
(an in-process test could pass because another test imported the module first)."""
import subprocess
import sys

CODE = """
import archlab
cfg = archlab.presets.get("llama2-7b")
assert archlab.accounting.param_count(cfg) == 6_738_415_616
assert archlab.build_model(archlab.presets.tiny("bert-base")).__class__ is archlab.EncoderLM
assert archlab.build_model(archlab.presets.tiny("t5-11b")).__class__ is archlab.EncoderDecoderLM
assert isinstance(archlab.TransformerLM(archlab.presets.tiny("llama2-7b")), archlab.TransformerLM)
assert callable(archlab.train.train) and callable(archlab.generate)
assert callable(archlab.corpora.iter_documents) and callable(archlab.diagnostics.diagnose)
assert archlab.ConfigError is archlab.ModelConfig.__init__.__globals__["ConfigError"]
print("ok")
"""


def test_public_names_resolve_from_a_fresh_import():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_python_dash_m_archlab_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "archlab", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for verb in ("demo", "presets", "train", "generate", "convert", "serve", "ngram"):
        assert verb in out.stdout
