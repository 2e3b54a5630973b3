"""TorchRec's ``torchrec.datasets.movielens``: ``movielens_20m`` / ``movielens_25m``, the ratings of a local
MovieLens folder (ratings.csv: userId,movieId,rating,timestamp; movies.csv: movieId,title,genres, as grouplens ships
them; nothing is downloaded) as {column: value} rows, optionally joined with their movie.
"""

import os
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Union

from torch.utils.data import IterDataPipe

from recship.datasets.utils import LoadFiles, ReadLinesFromCSV, safe_cast


def _int_or_0(val: Any) -> Any:
    return safe_cast(val, int, 0)


def _float_or_0(val: Any) -> Any:
    return safe_cast(val, float, 0.0)


def _str_or_empty(val: Any) -> Any:
    return safe_cast(val, str, "")


RATINGS_FILENAME = "ratings.csv"
MOVIES_FILENAME = "movies.csv"
DEFAULT_RATINGS_COLUMN_NAMES: List[str] = ["userId", "movieId", "rating", "timestamp"]
DEFAULT_MOVIES_COLUMN_NAMES: List[str] = ["movieId", "title", "genres"]
DEFAULT_COLUMN_NAMES: List[str] = DEFAULT_RATINGS_COLUMN_NAMES + DEFAULT_MOVIES_COLUMN_NAMES[1:]
COLUMN_TYPE_CASTERS: List[Callable[[Union[float, int, str]], Union[float, int, str]]] = [
    _int_or_0, _int_or_0, _float_or_0, _int_or_0, _str_or_empty, _str_or_empty]


def _movielens_row(example: List[str]) -> Dict[str, Union[float, int, str]]:
    """A ratings row (joined with its movie's title and genres, when asked) as {column: value}."""
    return {DEFAULT_COLUMN_NAMES[i]: COLUMN_TYPE_CASTERS[i](val) for i, val in enumerate(example)}


def _join_movie(movie_by_id: Dict[str, List[str]], root: str, row: List[str]) -> List[str]:
    """A ratings row followed by its movie's title and genres."""
    if row[1] not in movie_by_id:
        raise ValueError(f"{root}/{RATINGS_FILENAME}: movieId {row[1]!r} is not in {MOVIES_FILENAME}")
    return row + movie_by_id[row[1]]


def _movielens(root: str, include_movies_data: bool, row_mapper: Optional[Callable[[List[str]], Any]],
               **open_kw: Any) -> IterDataPipe:
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root}: no such MovieLens folder (it holds {RATINGS_FILENAME} and {MOVIES_FILENAME})")
    datapipe: IterDataPipe = ReadLinesFromCSV(LoadFiles((os.path.join(root, RATINGS_FILENAME),), mode="r", **open_kw),
                                              skip_first_line=True, delimiter=",")
    if include_movies_data:
        movies = ReadLinesFromCSV(LoadFiles((os.path.join(root, MOVIES_FILENAME),), mode="r"), skip_first_line=True,
                                  delimiter=",")
        movie_by_id: Dict[str, List[str]] = {row[0]: row[1:] for row in movies}
        datapipe = datapipe.map(partial(_join_movie, movie_by_id, root))
    if row_mapper:
        datapipe = datapipe.map(row_mapper)
    return datapipe


def movielens_20m(root: str, *, include_movies_data: bool = False,
                  row_mapper: Optional[Callable[[List[str]], Any]] = _movielens_row, **open_kw: Any) -> IterDataPipe:
    """The ratings of the MovieLens 20M folder ``root`` (files as grouplens ships them; nothing is downloaded), one
    {"userId": int, "movieId": int, "rating": float, "timestamp": int} per row, with "title" and "genres" when
    ``include_movies_data``; ``row_mapper=None`` gives the rows as lists of strings."""
    return _movielens(root, include_movies_data, row_mapper, **open_kw)


def movielens_25m(root: str, *, include_movies_data: bool = False,
                  row_mapper: Optional[Callable[[List[str]], Any]] = _movielens_row, **open_kw: Any) -> IterDataPipe:
    """As ``movielens_20m``, for the MovieLens 25M folder ``root`` (the same files and columns)."""
    return _movielens(root, include_movies_data, row_mapper, **open_kw)


__all__ = ["COLUMN_TYPE_CASTERS", "DEFAULT_COLUMN_NAMES", "DEFAULT_MOVIES_COLUMN_NAMES", "DEFAULT_RATINGS_COLUMN_NAMES",
           "LoadFiles", "MOVIES_FILENAME", "RATINGS_FILENAME", "ReadLinesFromCSV", "movielens_20m", "movielens_25m",
           "safe_cast"]
