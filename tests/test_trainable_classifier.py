"""Pixel classifiers: thresholds moved midway between labelled values."""

import numpy as np
import pytest

from alibi_vit.trainable.classifier import CLASSIFIERS, balanced_weights, fit_classifier, make_classifier

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
