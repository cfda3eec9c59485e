"""Pixel classifiers: XGBoost's forest and boosting through its own API (as its scikit-learn classes set them), and
without scikit-learn; thresholds moved midway between labelled values."""

import numpy as np
import pytest

from alibi_vit.trainable.classifier import (CLASSIFIERS, DEFAULTS, balanced_weights, fit_classifier, load_classifier,
                                             make_classifier)

SMALL = {"n_estimators": 5, "n_jobs": 1}


@pytest.mark.parametrize("kind", CLASSIFIERS)
def test_a_gap_between_two_classes_is_split_in_its_middle(kind):
    # One feature: class 0 at 0, class 1 at 10. Histogram splits put every threshold on 10 (x < 10 goes to
    # class 0); midway thresholds put it on 5, as an exact learner would.
    X = np.array([[0.0]] * 20 + [[10.0]] * 20, np.float32)
    y = np.array([0] * 20 + [1] * 20)
    unmoved = make_classifier(kind, **SMALL).fit(X, y, sample_weight=balanced_weights(y))
    assert unmoved.predict(np.array([[9.0]], np.float32))[0] == 0  # the artefact the midpoints remove
    clf = fit_classifier(kind, X, y, params=SMALL)
    probe = np.array([[4.9], [5.1], [9.0]], np.float32)
    assert clf.predict(probe).tolist() == [0, 1, 1]


@pytest.mark.parametrize("kind", CLASSIFIERS)
def test_midway_thresholds_leave_the_training_rows_predictions_unchanged(kind):
    rng = np.random.default_rng(0)
    X = np.round(rng.normal(size=(300, 4)), 1).astype(np.float32)  # repeated values, as grey levels give
    y = (X[:, 0] + 0.5 * X[:, 1] > 0).astype(int) + (X[:, 2] > 1)
    unmoved = make_classifier(kind, seed=3, **SMALL).fit(X, y, sample_weight=balanced_weights(y))
    clf = fit_classifier(kind, X, y, seed=3, params=SMALL)
    np.testing.assert_array_equal(clf.predict_proba(X), unmoved.predict_proba(X))
    unseen = rng.normal(size=(2000, 4)).astype(np.float32)  # mostly values between the rounded ones
    assert (clf.predict(unseen) != unmoved.predict(unseen)).any()


def test_a_classifier_loaded_in_the_background_predicts_and_pickles_as_the_saved_one(tmp_path):
    import pickle

    from alibi_vit.trainable.classifier import PendingClassifier, load_classifier, load_classifier_in_background

    rng = np.random.default_rng(1)
    X = rng.normal(size=(200, 3)).astype(np.float32)
    y = (X[:, 0] > 0).astype(int)
    path = tmp_path / "classifier.json"
    fit_classifier("random_forest", X, y, params=SMALL).save_model(path)
    expected = load_classifier("random_forest", path).predict_proba(X)
    pending = load_classifier_in_background("random_forest", path)
    path.unlink()  # read at once: a Dask worker's temporary copy of the model is gone before the thread loads it
    assert isinstance(pending, PendingClassifier)
    np.testing.assert_array_equal(pending.predict_proba(X), expected)
    copy = pickle.loads(pickle.dumps(pending))  # what a Dask worker receives: a plain classifier
    assert not isinstance(copy, PendingClassifier)
    np.testing.assert_array_equal(copy.predict_proba(X), expected)


def test_a_damaged_classifier_file_is_named_at_once_or_on_first_use(tmp_path):
    from alibi_vit.trainable.classifier import load_classifier_in_background

    truncated = tmp_path / "truncated.json"
    truncated.write_text('{"learner": {"truncated')
    with pytest.raises(ValueError, match=f"{truncated} is not a readable XGBoost model .*not valid JSON"):
        load_classifier_in_background("random_forest", truncated)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_classifier_in_background("random_forest", tmp_path / "missing.json")
    not_a_model = tmp_path / "other.json"
    not_a_model.write_text('{"learner": 1}')  # JSON, but not XGBoost's: found by the background load
    pending = load_classifier_in_background("random_forest", not_a_model)
    with pytest.raises(ValueError, match=f"{not_a_model} is not a readable XGBoost model"):
        pending.predict_proba(np.zeros((1, 3), np.float32))


@pytest.mark.parametrize("kind, reference", [("random_forest", "XGBRFClassifier"), ("xgboost", "XGBClassifier")])
@pytest.mark.parametrize("n_classes", [2, 4])
def test_the_classifier_is_xgboosts_own_forest_and_booster_set_as_its_scikit_learn_classes_set_them(
        kind, reference, n_classes, tmp_path):
    """Reference: XGBoost's scikit-learn classes with the same settings give the same probabilities, bit for bit,
    and each reads the other's model file."""
    import xgboost

    rng = np.random.default_rng(n_classes)
    X = np.round(rng.normal(size=(600, 5)), 2).astype(np.float32)
    y = np.digitize(X[:, 0] + X[:, 1] * X[:, 2], np.linspace(-1, 1, n_classes - 1))
    params = {"n_estimators": 7, "max_depth": 5}
    weights = balanced_weights(y)
    ours = make_classifier(kind, seed=4, n_jobs=1, **params).fit(X, y, sample_weight=weights)
    theirs = getattr(xgboost, reference)(**{**DEFAULTS[kind], **params}, random_state=4, n_jobs=1).fit(
        X, y, sample_weight=weights)
    unseen = rng.normal(size=(3000, 5)).astype(np.float32)
    expected = theirs.predict_proba(unseen)
    assert ours.predict_proba(unseen).shape == (3000, n_classes)
    np.testing.assert_array_equal(ours.predict_proba(unseen), expected)
    ours.save_model(tmp_path / "ours.json")
    read = getattr(xgboost, reference)()
    read.load_model(tmp_path / "ours.json")
    np.testing.assert_array_equal(read.predict_proba(unseen), expected)
    theirs.save_model(tmp_path / "theirs.json")
    np.testing.assert_array_equal(load_classifier(kind, tmp_path / "theirs.json").predict_proba(unseen), expected)


def test_a_fit_on_few_rows_predicts_on_every_core(tmp_path):
    """Fits below SINGLE_THREAD_ROWS run on one thread; the booster is then set back to XGBoost's default
    (nthread 0: every core, or OMP_NUM_THREADS) for prediction."""
    import json

    rng = np.random.default_rng(0)
    X = rng.normal(size=(500, 3)).astype(np.float32)
    y = (X[:, 0] > 0).astype(int)
    clf = fit_classifier("random_forest", X, y, params={"n_estimators": 3})
    assert json.loads(clf.get_booster().save_config())["learner"]["generic_param"]["nthread"] == "0"
    pinned = fit_classifier("random_forest", X, y, params={"n_estimators": 3, "n_jobs": 1})
    assert json.loads(pinned.get_booster().save_config())["learner"]["generic_param"]["nthread"] == "1"


def test_scikit_learn_is_refused_only_to_the_thread_importing_xgboost():
    import threading

    from alibi_vit.trainable.classifier import _NoScikitLearnInThisThread

    finder = _NoScikitLearnInThisThread()
    with pytest.raises(ModuleNotFoundError, match="sklearn.base is not imported with XGBoost"):
        finder.find_spec("sklearn.base")
    assert finder.find_spec("scipy") is None and finder.find_spec("sklearnx") is None
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(finder.find_spec("sklearn")))
    thread.start()
    thread.join()
    assert elsewhere == [None]


def test_a_fresh_process_fits_without_scikit_learn_and_its_own_xgboost_import_is_whole(tmp_path):
    """In a fresh process: the classifier's XGBoost is imported in the background without scikit-learn, under
    a private name; the forest is fitted, saved and pickled. The process's own ``import xgboost`` is then
    whole: its scikit-learn classes fit, and read the saved model with the same probabilities. The pickled
    classifier, bare booster and XGBoost error load in a fresh process that imported scikit-learn first (the
    ordinary XGBoost's classes there)."""
    import xgboost

    from tests.helpers import run_in_fresh_process

    script = ("import pickle, sys\nimport numpy as np\n"
              "from alibi_vit.trainable import classifier as c\n"
              "c.import_in_background()\n"
              "rng = np.random.default_rng(0)\nX = rng.normal(size=(400, 3)).astype(np.float32)\n"
              "y = (X[:, 0] > 0).astype(int) + (X[:, 1] > 1)\n"
              "clf = c.fit_classifier('random_forest', X, y, params={'n_estimators': 4})\n"
              "clf.save_model(sys.argv[1])\nnp.save(sys.argv[2], clf.predict_proba(X))\n"
              "open(sys.argv[3], 'wb').write(pickle.dumps((clf, clf.get_booster(), "
              "c.import_xgboost().core.XGBoostError('boom'))))\n"
              "print('sklearn' in sys.modules, 'xgboost' in sys.modules, type(clf.get_booster()).__module__)\n"
              "import xgboost\n"
              "ours = xgboost.XGBRFClassifier()\nours.load_model(sys.argv[1])\n"
              "print(np.array_equal(ours.predict_proba(X), clf.predict_proba(X)))\n"
              "other = xgboost.XGBClassifier(n_estimators=2).fit(X, y)\n"
              "import sklearn.base\nprint(isinstance(other, sklearn.base.BaseEstimator), "
              "xgboost is c.import_xgboost())\n")
    files = [str(tmp_path / name) for name in ("m.json", "p.npy", "c.pickle")]
    result = run_in_fresh_process(files, tmp_path, script, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "alibi_vit.trainable._xgboost.core", "True", "True", "False"]
    rng = np.random.default_rng(0)
    X = rng.normal(size=(400, 3)).astype(np.float32)
    expected = np.load(tmp_path / "p.npy")
    read = xgboost.XGBRFClassifier()
    read.load_model(tmp_path / "m.json")
    np.testing.assert_array_equal(read.predict_proba(X), expected)
    # Unpickled in a fresh process that imported scikit-learn first, so knows no private module
    unpickle = ("import sys, pickle\nimport sklearn\nimport numpy as np\nimport xgboost\n"
                "clf, booster, error = pickle.load(open(sys.argv[1], 'rb'))\n"
                "rng = np.random.default_rng(0)\nX = rng.normal(size=(400, 3)).astype(np.float32)\n"
                "expected = np.load(sys.argv[2])\n"
                "print(clf.n_classes_, np.array_equal(clf.predict_proba(X), expected), "
                "np.array_equal(booster.inplace_predict(X), expected), type(booster) is xgboost.Booster, "
                "type(error) is xgboost.core.XGBoostError and error.args == ('boom',), "
                "'alibi_vit.trainable._xgboost' in sys.modules)\n")
    result = run_in_fresh_process([files[2], files[1]], tmp_path, unpickle, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["3", "True", "True", "True", "True", "False"]


def test_a_process_that_imported_scikit_learn_first_uses_its_ordinary_xgboost(tmp_path):
    """With scikit-learn imported already XGBoost's import costs little: the classifier uses ``xgboost`` itself,
    no private copy."""
    from tests.helpers import run_in_fresh_process

    script = ("import sys\nimport sklearn\nfrom alibi_vit.trainable.classifier import PRIVATE_XGBOOST, import_xgboost\n"
              "module = import_xgboost()\nimport xgboost\n"
              "print(module is xgboost, PRIVATE_XGBOOST in sys.modules)\n")
    result = run_in_fresh_process([], tmp_path, script, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]


def test_the_ordinary_xgboost_is_used_when_the_private_import_fails(tmp_path):
    """In a fresh process whose private import fails (as it would for an XGBoost laid out otherwise): the
    classifier gets the ordinary ``xgboost``, whole, and fits."""
    from tests.helpers import run_in_fresh_process

    script = ("import sys\nimport numpy as np\nfrom alibi_vit.trainable import classifier as c\n"
              "def fail():\n    raise ImportError('laid out otherwise')\n"
              "c._import_private_xgboost = fail\nmodule = c.import_xgboost()\n"
              "X = np.arange(40, dtype=np.float32).reshape(20, 2)\ny = (X[:, 0] > 15).astype(int)\n"
              "clf = c.fit_classifier('random_forest', X, y, params={'n_estimators': 2})\n"
              "print(module is sys.modules['xgboost'], module.compat.SKLEARN_INSTALLED, clf.predict(X)[[0, -1]].tolist())\n")
    result = run_in_fresh_process([], tmp_path, script, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "[0,", "1]"]
